"""`pdserve bench step` (pdserve/bench/step.py): every variant runs, in order, on a tiny
batch, and each one's switches reach the engine (the kernels are off in the variants
before them)."""

import torch

from pdserve.bench import step
from pdserve.engine import attention, model


def test_variants_run_in_order_with_their_kernels(monkeypatch):
    seen = []
    real_decode = step.ModelRunner.decode

    def decode(self, seqs):
        seen.append((attention.use_cpu_kernel(torch.zeros(1, 1, 64), torch.zeros(1, 1, 16, 64)),
                     model.use_fused_ops(torch.zeros(1))))
        return real_decode(self, seqs)

    monkeypatch.setattr(step.ModelRunner, "decode", decode)
    results = step.run("default", ["float32"], batch=2, context=20, prefill_tokens=16,
                       repeats=1, threads=1)
    assert [r.variant for r in results] == ["eager", "+prepacked", "+paged_kernel",
                                            "+fused_ops", "+torch.compile"]
    assert all(r.decode_step_s > 0 and r.prefill_tokens_per_s > 0 for r in results)
    # 3 decode calls per variant (2 warm-up, 1 timed): kernels (paged, fused) per variant;
    # the compiled runner's warm-up adds 2 decode calls of its own
    assert seen == [(False, False)] * 6 + [(True, False)] * 3 + [(True, True)] * 8
    assert "+fused_ops" in step.table(results)


def test_run_gives_the_process_its_cpus_and_threads_back():
    import os
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    step.run("default", ["float32"], batch=1, context=4, prefill_tokens=4, repeats=1,
             threads=1)
    assert os.sched_getaffinity(0) == cpus and torch.get_num_threads() == threads
