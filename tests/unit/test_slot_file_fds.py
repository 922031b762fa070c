"""The SSD tier and the open-file limit: a checkpoint reads every away tensor through a map of
the rank's file (SlotFile.map), and a 200B model has tens of thousands of them. A map per tensor
held a descriptor per tensor (Python's mmap keeps a dup of the one it maps), so under the common
`ulimit -n 1024` the save ran out of descriptors. Now every tensor is a view of one map of the
file: the descriptors a save holds do not grow with the tensors it reads.

Each case runs in a child process whose soft RLIMIT_NOFILE is 256 (this process keeps its own),
with more tensors than that. Running out of descriptors, where it still happens, is named as the
open-file limit with its value, never as a bad offload directory."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 256
TENSORS = 300  # away tensors read for one save, all held at once: more than LIMIT

CHILD = textwrap.dedent("""
    import json, os, resource, sys
    import torch
    from megatron_grpo.offload import ChunkStore, OffloadConfig
    from megatron_grpo.offload.placement import AWAY, TierPlacement

    directory, limit, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    def fds():
        return len(os.listdir("/proc/self/fd"))

    def config(sub):
        os.makedirs(os.path.join(directory, sub))
        # 16 KiB chunks: every tensor below is one chunk (4-8 KB), one 8 KiB extent
        return OffloadConfig(chunk_mb=16384 / (1 << 20), io_workers=1, capacity=2 * n * 16384,
                             offload_dir=os.path.join(directory, sub))

    g = torch.Generator().manual_seed(0)
    out = {}

    # The store: n tensors on ssd, each read for a save and all kept, as the writer keeps them.
    tensors = [torch.randn(1000 + k, generator=g) for k in range(n)]
    with ChunkStore(config("store"), rank=3) as store:
        ids = [store.register(f"t{k}", t) for k, t in enumerate(tensors)]
        for chunk_ids in ids:
            for i in chunk_ids:
                store.evict(i, "ssd")
        store.wait_all()
        before = fds()
        saved = [store.host_bytes(i).view(torch.float32) for i in ids]
        out["store"] = dict(before=before, during=fds(), reads=store.stats()["checkpoint_reads"],
                            equal=all(torch.equal(s, t) for s, t in zip(saved, tensors)))
        del saved
    out["store"]["after"] = fds()

    # The placement, as a save in training reads it: two streamed units away, n tensors in all.
    st = {(u, "moments"): [(f"m{k}", torch.randn(1500, generator=g)) for k in range(n // 2)]
          for u in range(3)}
    ref = {(key, name): t.clone() for key, pairs in st.items() for name, t in pairs}
    p = TierPlacement(ChunkStore(config("placement"), rank=3), "ssd", stream=True)
    try:
        p.add(st)
        p.begin_step(["dynamic"] * 3, update_now=False, update_next=False)
        p.prepare_save()
        away = [key for key, unit in p.units.items() if unit.state == AWAY]
        before = fds()
        saved = {(key, name): p.saved_tensor(t) for key, pairs in st.items() for name, t in pairs}
        out["placement"] = dict(away=len(away) * (n // 2), before=before, during=fds(),
                                reads=p.store.stats()["checkpoint_reads"],
                                equal=all(torch.equal(t, ref[k]) for k, t in saved.items()))
        del saved
    finally:
        p.close()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def under_limit(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fds")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(directory), str(LIMIT), str(TENSORS)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_store_maps_more_tensors_than_the_open_file_limit_on_one_descriptor(under_limit):
    r = under_limit["store"]
    assert r["equal"]
    # Every tensor came through the map (a failed map falls back to a copying read: the old
    # map per tensor did so for every tensor past the limit), and the descriptors held while
    # all of them live are the map's one.
    nbytes = sum(4 * (1000 + k) for k in range(TENSORS))
    assert r["reads"] == {"mapped": nbytes, "host": 0, "copied": 0}
    assert r["during"] - r["before"] <= 1, r
    assert r["after"] <= r["before"]  # the store closed: its descriptors and the map are gone


def test_a_save_through_the_placement_reads_more_tensors_than_the_limit(under_limit):
    r = under_limit["placement"]
    assert r["away"] > LIMIT and r["equal"]
    assert r["reads"]["mapped"] == r["away"] * 1500 * 4 and r["reads"]["copied"] == 0, r
    assert r["during"] - r["before"] <= 1, r


OPEN_FAILS = textwrap.dedent("""
    import os, resource, sys, tempfile
    from megatron_grpo.offload import ChunkStore, OffloadConfig

    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    # fallback cpu: a bad directory would fall back; the open-file limit must not be hidden so
    ChunkStore(OffloadConfig(chunk_mb=0.25, capacity=1 << 20, offload_dir=sys.argv[1], fallback="cpu"), rank=7)
""")


def test_out_of_descriptors_at_the_tier_file_names_the_limit_not_the_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-c", OPEN_FAILS, str(tmp_path), str(LIMIT)], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_grpo.offload.slot_file.OffloadOpenFilesError: offload (rank 7): "
                           "opening the SSD tier's file "), last
    assert (f"this process has reached its open-file limit (EMFILE, errno 24: Too many open files; "
            f"`ulimit -n` is {LIMIT} here") in last and "`ulimit -n 65536` in the sbatch script" in last
    assert "offload directory" not in last
