"""Resident memory of a pipeline stage against its share of the weights.

Writes a random-weight llama fixture large enough that its weights dominate a
process's memory (8 layers, hidden 1024, float32: about 0.5 GB), then loads,
each in a fresh subprocess: the whole model with mlx-lm's own ``load_model``,
the whole model as one stage, halves and quarters. For each it prints the
bytes of the parameters the stage holds, the RSS growth over the bare process
(mlx and mlx-lm imported), the peak RSS growth, and mlx's peak allocation.
A stage that read the other stages' weights would show it in the peaks.

    .venv/bin/python bench/stage_memory.py [--layers 8] [--hidden 1024] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1 << 20


def measure(path: str, start: int, end: int) -> dict[str, int]:
    """In this process: load layers [start, end) (-1, -1: mlx-lm's load_model) and measure."""
    import mlx.core as mx
    import psutil
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from mlxceld.models.slicing import load_stage

    proc = psutil.Process()
    base = proc.memory_info().rss
    if start < 0:
        model, _ = load_model(Path(path))
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    else:
        model = load_stage(path, start, end)  # kept alive until measured
        weights = model.nbytes
    return {"weights": weights, "rss": proc.memory_info().rss - base,
            "peak_rss": peak_rss() - base,
            "mlx_peak": mx.get_peak_memory(), "base": base}


def peak_rss() -> int:
    """This process's peak RSS. On Linux VmHWM, which restarts at exec: ru_maxrss would
    carry over the peak of the parent that forked us (it wrote the fixture)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def run_child(path: Path, start: int, end: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, __file__, "--child", str(path), str(start), str(end)],
                         check=True, capture_output=True, text=True).stdout
    result: dict[str, int] = json.loads(out)
    return result


def write_model(directory: Path, layers: int, hidden: int) -> Path:
    from mlxceld.models import preset, write_fixture

    spec = preset("tiny", family="llama", layers=layers, hidden=hidden, heads=hidden // 64,
                  kv_heads=hidden // 128, intermediate=hidden * 11 // 4, vocab=8192,
                  tokenizer_vocab=512, dtype="float32")
    return write_fixture(directory / "model", spec)


def report(path: Path, layers: int) -> None:
    cases = [("mlx-lm load_model (whole)", -1, -1), ("stage [0, N) (whole)", 0, layers),
             ("first half", 0, layers // 2), ("last half", layers // 2, layers),
             ("first quarter", 0, layers // 4), ("middle quarter", layers // 4, layers // 2),
             ("last quarter", layers - layers // 4, layers)]
    files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"model {path}: {layers} layers, {files / MB:.1f} MiB of safetensors")
    print(f"{'what':<28}{'layers':>9}{'weights':>11}{'RSS +':>11}{'peak RSS +':>12}"
          f"{'mlx peak':>11}{'RSS/weights':>13}")
    for name, start, end in cases:
        m = run_child(path, start, end)
        span = "all" if start < 0 else f"[{start},{end})"
        print(f"{name:<28}{span:>9}{m['weights'] / MB:>10.1f}M{m['rss'] / MB:>10.1f}M"
              f"{m['peak_rss'] / MB:>11.1f}M{m['mlx_peak'] / MB:>10.1f}M"
              f"{m['rss'] / m['weights']:>13.2f}")
    print(f"RSS + and peak RSS + are over the bare process: {m['base'] / MB:.1f} MiB "
          "with mlx and mlx-lm imported")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024, help="a multiple of 128")
    parser.add_argument("--model", type=Path, help="an existing llama/qwen checkpoint")
    args = parser.parse_args()
    if args.model is not None:
        config = json.loads((args.model / "config.json").read_text())
        report(args.model, config["num_hidden_layers"])
        return
    with tempfile.TemporaryDirectory(prefix="stage-memory-") as tmp:
        report(write_model(Path(tmp), args.layers, args.hidden), args.layers)


if __name__ == "__main__":
    main()
