"""bench/vllm_peer_table.py: the ratio table of `make bench-vllm`, each figure's median
over the runs when a system ran several times (REPEATS)."""

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "vllm_peer_table", Path(__file__).parents[2] / "bench" / "vllm_peer_table.py")
vllm_peer_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_peer_table)


def _result(path: Path, tok_s: float, ttft_ms: float) -> Path:
    path.write_text(json.dumps({
        "completed": 64, "num_prompts": 64, "request_throughput": tok_s / 128,
        "output_throughput": tok_s, "request_goodput": None, "mean_ttft_ms": ttft_ms,
        "mean_tpot_ms": 100.0}))
    return path


def test_median_figures_per_system_and_the_ratio_between_them(tmp_path):
    files = [_result(tmp_path / f"vllm_peer_pdserve_fp32_inf_run{k}.json", tok, ttft)
             for k, (tok, ttft) in enumerate([(440.0, 4000), (400.0, 4500), (420.0, 5000)], 1)]
    files += [_result(tmp_path / f"vllm_peer_vllm_fp32_inf_run{k}.json", tok, 4200)
              for k, tok in enumerate([350.0, 410.0], 1)]
    lines = vllm_peer_table.table(files).splitlines()
    rows = {line.split()[2]: line.split() for line in lines[1:] if line.split()[0] == "inf"}
    # each figure its own median: 420 tok/s (run 3), 4500 ms TTFT (run 2)
    assert rows["pdserve"][5] == "420.0" and rows["pdserve"][7] == "4500ms"
    assert rows["vllm"][5] == "350.0"                       # even count: the lower middle
    assert rows["pdserve/vllm"][4] == "1.20x"               # 420 / 350
    assert any("3 runs (tok/s, TTFT, TPOT): 440.0 4000ms 100.0ms, 400.0 4500ms 100.0ms, "
               "420.0 5000ms 100.0ms" in line for line in lines)
