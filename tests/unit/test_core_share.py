"""pdserve/core_share.py: prefill workers' busy flags and the threads a decode worker
borrows from the idle ones (shared files in a temporary directory, no Ray)."""

import pytest

from pdserve import core_share
from pdserve.config import ClusterConfig, WorkerConfig
from pdserve.core_share import CompileActivity, LentThreads, PrefillActivity


@pytest.fixture
def rescan_always(monkeypatch):
    monkeypatch.setattr(core_share, "RESCAN_S", 0.0)


def test_decode_borrows_only_idle_prefill_threads_up_to_its_cap(tmp_path):
    lent = LentThreads(str(tmp_path), "decode-0", own_threads=1, max_threads=4)
    assert lent.threads() == 1                       # nothing published yet
    p0 = PrefillActivity(str(tmp_path), "prefill-0", threads=2)
    p1 = PrefillActivity(str(tmp_path), "prefill-1", threads=2)
    lent._scanned = float("-inf")                    # (a rescan is due every RESCAN_S)
    assert lent.threads() == 1                       # both start busy
    p0.set_busy(False)
    assert lent.threads() == 3                       # read live, no rescan needed
    p1.set_busy(False)
    assert lent.threads() == 4                       # capped: the node's cores
    p0.set_busy(True)
    assert lent.threads() == 3
    for p in (p0, p1):
        p.close()
    lent.close()


def test_no_threads_are_lent_while_a_process_of_the_node_compiles_a_grammar(
        tmp_path, rescan_always):
    """A router's (or any worker's) grammar compile, published as `<owner>.compiling`:
    the decode worker runs on its own threads until every compile ended; nested and
    concurrent compiles of one process count; the flag's file goes with close()."""
    lent = LentThreads(str(tmp_path), "decode-0", own_threads=1, max_threads=2)
    p = PrefillActivity(str(tmp_path), "prefill-0", threads=1)
    p.set_busy(False)
    router = CompileActivity(str(tmp_path), "router-0")
    assert lent.threads() == 2
    with router.compiling():
        assert lent.threads() == 1
        with router.compiling():
            assert lent.threads() == 1
        assert lent.threads() == 1                   # one still compiling
    assert lent.threads() == 2
    off = CompileActivity(None, "router-1")          # no lending: publishes nothing
    with off.compiling():
        assert lent.threads() == 2
    router.close()
    assert not list(tmp_path.glob("*.compiling"))
    p.close()
    lent.close()


def test_a_restarted_or_stopped_prefill_worker_is_noticed(tmp_path, rescan_always):
    lent = LentThreads(str(tmp_path), "decode-0", own_threads=1, max_threads=2)
    old = PrefillActivity(str(tmp_path), "prefill-0", threads=1)
    old.set_busy(False)
    assert lent.threads() == 2
    new = PrefillActivity(str(tmp_path), "prefill-0", threads=1)   # Ray restarted it
    assert lent.threads() == 1                       # the new incarnation starts busy
    new.set_busy(False)
    assert lent.threads() == 2
    new.close()                                      # shutdown: its file goes
    assert lent.threads() == 1
    lent.close()
    assert not list(tmp_path.iterdir())              # nothing left behind


def test_a_removed_directory_lends_nothing(tmp_path, rescan_always):
    import shutil
    lent = LentThreads(str(tmp_path / "share"), "decode-0", own_threads=2, max_threads=8)
    p = PrefillActivity(str(tmp_path / "share"), "prefill-0", threads=2)
    p.set_busy(False)
    assert lent.threads() == 4
    shutil.rmtree(tmp_path / "share")                # the cluster stopped
    assert lent.threads() == 2
    lent.close()


def test_decode_workers_of_a_node_split_the_idle_threads(tmp_path, rescan_always):
    """Each would otherwise take every idle thread: 3 decode workers of 2 threads on an
    8-core node with 1 idle prefill worker of 2 threads would run 12 threads on 8 cores."""
    d = [LentThreads(str(tmp_path), f"decode-{i}", own_threads=2, max_threads=8)
         for i in range(3)]
    p = PrefillActivity(str(tmp_path), "prefill-0", threads=2)
    p.set_busy(False)
    assert [x.threads() for x in d] == [3, 3, 2]      # 2 idle threads, 3 decode workers
    d[2].close()
    assert [x.threads() for x in d[:2]] == [3, 3]
    p.close()
    assert [x.threads() for x in d[:2]] == [2, 2]
    for x in d[:2]:
        x.close()


def test_cluster_lends_only_for_unpinned_cpu_workers():
    assert ClusterConfig().lends_idle_prefill_cores()
    assert not ClusterConfig(lend_idle_prefill_cores=False).lends_idle_prefill_cores()
    pinned = WorkerConfig(cpus=(1,))
    assert not ClusterConfig(decode=pinned).lends_idle_prefill_cores()
    assert not ClusterConfig(gpus_per_worker=1).lends_idle_prefill_cores()
    assert not ClusterConfig(prefill=WorkerConfig(device="cuda"),
                             decode=WorkerConfig(device="cuda")).lends_idle_prefill_cores()
