"""bench/vllm_peer_table.py: the ratio table of `make bench-vllm`, a median run per system
when it ran several times (REPEATS)."""

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


def test_median_run_per_system_and_the_ratio_between_them(tmp_path):
    files = [_result(tmp_path / f"vllm_peer_pdserve_fp32_inf_run{k}.json", tok, ttft)
             for k, (tok, ttft) in enumerate([(440.0, 4000), (400.0, 5000), (420.0, 4500)], 1)]
    files += [_result(tmp_path / f"vllm_peer_vllm_fp32_inf_run{k}.json", tok, 4200)
              for k, tok in enumerate([350.0, 410.0], 1)]
    lines = vllm_peer_table.table(files).splitlines()
    rows = {line.split()[2]: line.split() for line in lines[1:] if line.split()[0] == "inf"}
    assert rows["pdserve"][5] == "420.0" and rows["pdserve"][7] == "4500ms"   # the median run
    assert rows["vllm"][5] == "350.0"                       # even count: the lower middle
    assert rows["pdserve/vllm"][4] == "1.20x"               # 420 / 350
    assert any("3 runs, out tok/s: 440.0, 400.0, 420.0" in line for line in lines)
