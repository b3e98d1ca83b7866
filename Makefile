# dejavu-lab: `make test` and `make book` each bootstrap .venv on a fresh machine.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# JavaScript the static book serves itself (no CDN): pinned npm tarballs, checked by sha256.
REQUIREJS := requirejs@2.3.7
HTML_MANAGER := @jupyter-widgets/html-manager@1.0.14
MATHJAX := mathjax@3.2.2
VENDOR := _static/vendor

.PHONY: test book lab bench gpu-check lint clean chromium

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev,book,kernels,eval]"
	touch $(STAMP)

# The rendered-page tests drive Debian's chromium; install it where we can (root + apt).
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium could not be installed: the rendered-page tests will be skipped"

# One worker per core, each taking whole files (a file's fixtures — the book build, the demo
# model — load once): the book's build runs beside the rest of the suite.
test: $(STAMP) chromium
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n auto --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

$(VENDOR)/require.js $(VENDOR)/embed-amd.js: _static/vendor.sha256
	rm -rf $(VENDOR) && mkdir -p $(VENDOR) && tmp=$$(mktemp -d) && \
	(cd $$tmp && npm pack --silent $(REQUIREJS) $(HTML_MANAGER) $(MATHJAX) >/dev/null) && \
	tar -xzf $$tmp/requirejs-*.tgz -C $$tmp package/require.js && mv $$tmp/package/require.js $(VENDOR)/ && \
	tar -xzf $$tmp/jupyter-widgets-html-manager-*.tgz -C $$tmp package/dist && \
	mv $$tmp/package/dist/embed-amd.js $$tmp/package/dist/*.woff2 $(VENDOR)/ && \
	mkdir -p $(VENDOR)/mathjax && \
	tar -xzf $$tmp/mathjax-*.tgz -C $(VENDOR)/mathjax --strip-components=1 \
	  package/es5/tex-mml-chtml.js package/es5/output/chtml/fonts/woff-v2 && rm -rf $$tmp && \
	(cd _static && sha256sum -c --quiet vendor.sha256)

# The execution cache is keyed on each notebook's code; a change to the package also
# invalidates it, so a chapter never shows results of code that no longer exists.
PKG_HASH = $(shell cat $$(find dejavu_lab -name '*.py' | sort) | sha256sum | cut -c1-16)

book: $(STAMP) $(VENDOR)/require.js
	@mkdir -p _build && if [ "$$(cat _build/.pkg-hash 2>/dev/null)" != "$(PKG_HASH)" ]; then \
	  rm -rf _build/.jupyter_cache _build/.doctrees && echo "$(PKG_HASH)" > _build/.pkg-hash; fi
	$(BIN)/jupyter-book build . -W --keep-going

lab: $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[lab]"
	$(BIN)/python -m ipykernel install --user --name dejavu-lab --display-name "dejavu-lab"
	$(BIN)/jupyter lab notebooks/

bench: $(STAMP)
	@$(BIN)/python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 'make bench needs an NVIDIA GPU; on a GPU box run it there (book/reproduce.md).')"
	for f in kernels/bench_*.py; do $(BIN)/python $$f || exit 1; done

# On a GPU box: the kernel tests compiled for the GPU, then the chapters that measure live
# (60, 65, 70, 75) executed as notebooks; a table, and the log in results/gpu_check.log.
gpu-check: $(STAMP)
	$(BIN)/python kernels/gpu_check.py

clean:
	rm -rf _build $(VENDOR) .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
