// ipywidgets' embed-amd.js loads its icon fonts from beside the module it defines
// ("@jupyter-widgets/html-manager/dist/libembed-amd"), which require.js would otherwise place
// under each page's own folder, where no font is. Map that module to _static/vendor, where
// `make book` unpacks the fonts with embed-amd.js. Runs after require.js, before embed-amd.js.
(function () {
  var src = document.currentScript.src;
  var vendor = src.slice(0, src.lastIndexOf("/")) + "/vendor";
  require.config({ paths: { "@jupyter-widgets/html-manager/dist": vendor } });
})();
