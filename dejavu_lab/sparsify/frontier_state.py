"""A frontier run that survives a kill: every finished point kept in one state file.

A frontier on a real model is hours of CPU (a 1.5B model reads a 512-token window in ~15 s;
each point reads 8 of them), so ``dejavu-lab frontier`` writes each (variant, sparsity) point
as soon as it is measured, and a rerun skips what is there. The run's folder is named by a
hash of everything a point's number depends on except the variant and sparsity themselves —
the model's fingerprint and dtype, the hashes of the evaluated and calibration token windows,
the window, the calibration settings — so a rerun adding variants or sparsities shares the
folder and computes only the new points, while another model or text gets another folder::

    <root>/<fingerprint_id>-<key>/state.json   {"format", "inputs", "points": [{"spec",
                                                 "sparsity", "row"}, ...]}
    <root>/<fingerprint_id>-<key>/lock         held while a process runs it

The state file is replaced atomically after each point (:func:`dejavu_lab.atomic.write_json`),
so a kill leaves the previous state or the new one, never half a file; a file damaged by other
means is one sentence (:class:`~dejavu_lab.errors.ResultsError`) saying to delete it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..atomic import locked, write_json
from ..errors import ResultsError
from ..vocab import fingerprint_id

__all__ = ["FORMAT", "FrontierState", "point_key", "run_key"]

FORMAT = "dejavu-lab-frontier-state/1"


def run_key(inputs: dict) -> str:
    """Hash of a run's inputs (JSON, keys sorted): the state folder's name.

    >>> run_key({"window": 512, "text": "ab"}) == run_key({"text": "ab", "window": 512})
    True
    """
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def point_key(spec: dict, sparsity: float) -> str:
    """One point's identity inside a run: the variant's spec and the sparsity, not its label.

    >>> point_key({"method": "teal", "allocation": "greedy"}, 0.5)
    '{"sparsity": 0.5, "spec": {"allocation": "greedy", "method": "teal"}}'
    """
    return json.dumps({"sparsity": float(sparsity), "spec": spec}, sort_keys=True)


class FrontierState:
    """The finished points of one run, read from and written to ``folder/state.json``.

    >>> import tempfile
    >>> fp = {"model_type": "llama", "n_layers": 2, "d_model": 64, "weights_sha256": "ab" * 8}
    >>> root = tempfile.mkdtemp()
    >>> state = FrontierState.open(root, {"fingerprint": fp, "window": 16})
    >>> state.folder.name.startswith("llama-L2-d64-abababababab-"), state.get({"method": "cats"}, 0.5)
    (True, None)
    >>> state.add({"method": "cats"}, 0.5, {"perplexity": 31.0})
    >>> again = FrontierState.open(root, {"fingerprint": fp, "window": 16})
    >>> again.get({"method": "cats"}, 0.5)["perplexity"], len(again)
    (31.0, 1)
    """

    def __init__(self, folder: Path, inputs: dict, points: dict[str, dict]):
        self.folder = folder
        self.inputs = inputs
        self.points = points  # point_key -> row

    @property
    def path(self) -> Path:
        return self.folder / "state.json"

    @classmethod
    def open(cls, root: str | Path, inputs: dict) -> FrontierState:
        """The run of ``inputs`` (must hold ``fingerprint``) under ``root``: its saved points, or
        none yet. A damaged state file is a :class:`ResultsError`."""
        inputs = json.loads(json.dumps(inputs, sort_keys=True))  # the form it is saved in
        folder = (
            Path(root).expanduser() / f"{fingerprint_id(inputs['fingerprint'])}-{run_key(inputs)}"
        )
        state = cls(folder, inputs, {})
        state.reload()
        return state

    def reload(self) -> None:
        """Read the points saved so far (another process may have added some)."""
        self.points = self._read() if self.path.exists() else {}

    def _read(self) -> dict[str, dict]:
        path = self.path
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            if data.get("inputs") != self.inputs:
                raise ValueError("its inputs are not this run's")
            points = {}
            for p in data["points"]:
                ppl = p["row"]["perplexity"]
                if not (ppl is None or isinstance(ppl, float)):
                    raise ValueError("a point has no perplexity")
                points[point_key(p["spec"], p["sparsity"])] = p["row"]
            return points
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise ResultsError(
                f"the frontier state {path} is damaged ({e}); delete it to compute its points "
                "again, or keep it aside and run with another state folder."
            ) from None

    def __len__(self) -> int:
        return len(self.points)

    def get(self, spec: dict, sparsity: float) -> dict | None:
        """The saved row of this point, or None when it still has to be measured."""
        return self.points.get(point_key(spec, sparsity))

    def seed(self, recording: dict) -> int:
        """Take the points of a ``dejavu-lab frontier --record`` file (``{"provenance",
        "rows"}``) that this state lacks, when the recording measured this run's inputs (same
        model fingerprint, dtype, window, texts, calibration settings); return how many were
        taken. A new machine then extends a recording without recomputing it; each taken row
        keeps the ``git_sha`` and ``computed_at`` it was measured with.

        >>> import tempfile
        >>> fp = {"model_type": "llama", "n_layers": 2, "d_model": 64, "weights_sha256": "ab" * 8}
        >>> inputs = {"fingerprint": fp, "dtype": "float32", "window": 16, "evaluated_sha": "e",
        ...           "calibration_sha": "c", "train_tokens": 64, "calibration_config": ["k"]}
        >>> rec = {"provenance": {"model_fingerprint": fp, "dtype": "float32", "window": 16,
        ...        "text_sha": {"evaluated": "e", "calibration": "c"}, "train_tokens": 64,
        ...        "calibration_config": ["k"], "variants": {"cats": {"method": "cats"}}},
        ...        "rows": [{"variant": "cats", "sparsity": 0.5, "perplexity": 31.0,
        ...                  "ppl_ratio": 1.1, "git_sha": "abc"}]}
        >>> state = FrontierState.open(tempfile.mkdtemp(), inputs)
        >>> state.seed(rec), state.get({"method": "cats"}, 0.5)["git_sha"]
        (1, 'abc')
        >>> state.seed({**rec, "provenance": {**rec["provenance"], "window": 32}})  # other run
        0
        """
        prov = recording.get("provenance") or {}
        text = prov.get("text_sha") or {}
        theirs = {
            "fingerprint": prov.get("model_fingerprint"),
            "dtype": prov.get("dtype"),
            "window": prov.get("window"),
            "evaluated_sha": text.get("evaluated"),
            "calibration_sha": text.get("calibration"),
            "train_tokens": prov.get("train_tokens"),
            "calibration_config": prov.get("calibration_config"),
        }
        if json.loads(json.dumps(theirs, sort_keys=True)) != self.inputs:
            return 0
        variants = {"dense": {"method": "dense"}, **(prov.get("variants") or {})}
        taken = 0
        for row in recording.get("rows") or []:
            spec = variants.get(row.get("variant"))
            if spec is None or self.get(spec, row["sparsity"]) is not None:
                continue
            kept = {k: v for k, v in row.items() if k not in ("variant", "ppl_ratio")}
            self.points[point_key(spec, row["sparsity"])] = kept
            taken += 1
        if taken:
            self._save()
        return taken

    def add(self, spec: dict, sparsity: float, row: dict) -> None:
        """Keep ``row`` (stamped ``computed_at``; a perplexity that overflowed saved as None,
        JSON has no inf) and replace the state file atomically."""
        now = _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v
               for k, v in row.items()}  # fmt: skip
        self.points[point_key(spec, sparsity)] = {**row, "computed_at": now}
        self._save()

    def _save(self) -> None:
        points = [{**json.loads(k), "row": r} for k, r in self.points.items()]
        hint = "free space there or pass another state folder"
        write_json(
            self.path, {"format": FORMAT, "inputs": self.inputs, "points": points}, hint=hint
        )

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Only one process runs this state at a time; a second waits for the first."""
        with locked(self.folder / "lock", what="running this frontier"):
            yield
