"""Data-parallel training under torchrun (2 CPU processes, gloo) gives the same draft as one
process with the same global batch; also exercises the CLI and the target directory's own
Hugging Face tokenizer."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longspec.cli import main
from test_training import ALPHABET, write_corpus

REPO = Path(__file__).resolve().parents[1]


def save_char_tokenizer(path: Path) -> None:
    """A character-level Hugging Face tokenizer (same ids as test_training.CharTokenizer)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"</s>": 0, "<s>": 1, **{ch: 2 + i for i, ch in enumerate(ALPHABET)}, "<unk>": 2 + len(ALPHABET)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))


def common_args(target, corpus, out):
    return ["train", "--target", str(target), "--data", str(corpus), "--out", str(out), "--seq-len", "32",
            "--steps", "6", "--lr", "3e-3", "--warmup", "2", "--window", "16", "--max-lag", "3",
            "--eval-fraction", "0.2", "--eval-every", "3", "--eval-chunks", "8", "--save-every", "3",
            "--log-every", "1", "--no-progress", "--device", "cpu", "--seed", "7"]


def test_torchrun_two_processes_match_one(tiny_model_factory, tmp_path, capsys):
    _, target = tiny_model_factory("ddp-llama", "llama", max_position_embeddings=256, seed=5)
    save_char_tokenizer(target)
    corpus = write_corpus(tmp_path / "corpus.jsonl", docs=30)

    # two ranks, 1 chunk x 2 accumulation steps each: global batch 4
    ddp_out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "longspec.cli", *common_args(target, corpus, ddp_out), "--batch-size", "1", "--grad-accum", "2"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["step"] == 6 and "eval_loss" in summary
    assert "2 process(es), global batch 4" in proc.stderr

    # one process, 2 chunks x 2 accumulation steps: the same global batch, split differently
    one_out = tmp_path / "one"
    assert main(common_args(target, corpus, one_out) + ["--batch-size", "2", "--grad-accum", "2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 6

    a, b = load_file(ddp_out / "model.safetensors"), load_file(one_out / "model.safetensors")
    assert a.keys() == b.keys()
    # Float summation order differs (other micro-batch sizes, all-reduce), and Adam turns rounding
    # noise in near-zero gradients into full-size steps (the self-attention k bias has an exactly
    # zero gradient: its updates are pure noise), so compare norms, not single elements.
    flat = lambda d: torch.cat([d[k].flatten() for k in sorted(d)])  # noqa: E731
    assert float((flat(a) - flat(b)).norm()) <= 1e-5 * float(flat(b).norm())
    for name in a:
        assert float((a[name] - b[name]).norm()) <= 1e-4 * float(b[name].norm()), name
    rows = {k: [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            for k, out in (("ddp", ddp_out), ("one", one_out))}
    assert [r["step"] for r in rows["ddp"]] == [r["step"] for r in rows["one"]]
    for r, s in zip(rows["ddp"], rows["one"]):
        for key in ("loss", "eval_loss", "eval_acc", "grad_norm"):
            if key in s:
                assert abs(r[key] - s[key]) <= 1e-5 * max(1.0, abs(s[key])), (key, r, s)
    # torchrun wrote a complete, resumable run from rank 0 only
    assert sorted(p.name for p in (ddp_out / "checkpoints").glob("step-*")) == ["step-00000003", "step-00000006"]
    assert torch.load(ddp_out / "checkpoints" / "step-00000006" / "trainer_state.pt", weights_only=True)[
        "world_size"] == 2


def torchrun(args, tmp_path, extra_env=None, timeout=300, wait=True):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", **(extra_env or {})}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # (--tee 3: each rank's own output in the streams too, prefixed by rank: a failing rank says why)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--tee", "3",
           "-m", "longspec.cli", *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def test_a_failing_rank_stops_the_job_with_its_message(tiny_model_factory, tmp_path):
    """A data error on rank 1 only: the job ends (no hang), non-zero, naming the error."""
    _, target = tiny_model_factory("ddp-llama", "llama", max_position_embeddings=256, seed=5)
    save_char_tokenizer(target)
    corpus = write_corpus(tmp_path / "corpus.jsonl", docs=30)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import longspec.training.run as t\n"
        "    def broken(*args, **kwargs):\n"
        "        raise ValueError('corrupt shard on rank 1')\n"
        "    t.build_data = broken\n")
    proc = torchrun([*common_args(target, corpus, tmp_path / "out"), "--batch-size", "1"], tmp_path,
                    {"PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}, timeout=240)
    assert proc.returncode != 0
    assert "corrupt shard on rank 1" in proc.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


def processes_mentioning(text: str) -> list:
    """PIDs of the processes whose command line contains ``text`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found


def wait_until_gone(text: str, timeout: float = 20.0) -> None:
    """Waits until no process mentions ``text``; fails if one outlives ``timeout``: a killed run
    must leave nothing writing to its directory."""
    import time

    deadline = time.time() + timeout
    while processes_mentioning(text):
        assert time.time() < deadline, f"processes of the killed run survive: {processes_mentioning(text)}"
        time.sleep(0.05)


def test_workers_die_with_a_killed_launcher(tmp_path):
    """torchrun starts each worker in a session of its own: a launcher killed with SIGKILL (not
    its workers) must not leave them running (and writing checkpoints): they die with it."""
    import signal
    import time

    script = tmp_path / "idle_worker.py"
    script.write_text("import sys, time\nfrom pathlib import Path\nfrom longspec.training import distributed\n"
                      "env = distributed.setup('cpu')\n(Path(sys.argv[1]) / f'ready-{env.rank}').touch()\n"
                      "time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), str(tmp_path)], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 180
        while len(list(tmp_path.glob("ready-*"))) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert len(list(tmp_path.glob("ready-*"))) == 2, "the workers did not start"
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only
        proc.wait()
        wait_until_gone(str(script))
    finally:
        for pid in processes_mentioning(str(script)):  # whatever survived a failure
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # (three runs of two processes; one process's bit-exact resume: test_training.py)
def test_killed_run_resumes_with_two_or_one_processes(tiny_model_factory, tmp_path):
    """A 2-process run killed (SIGKILL to the launcher's group; its workers die with it) once its
    step-3 checkpoint exists — cut
    back to that checkpoint if it was quicker than the kill — resumed with 2 processes ends where
    an uninterrupted run ends; resumed with 1 process (same global batch) it follows the same data
    and ends within rounding of it."""
    import signal
    import time

    _, target = tiny_model_factory("ddp-llama", "llama", max_position_embeddings=256, seed=5)
    save_char_tokenizer(target)
    corpus = write_corpus(tmp_path / "corpus.jsonl", docs=30)
    per_rank = ["--batch-size", "1", "--grad-accum", "2"]
    full = torchrun([*common_args(target, corpus, tmp_path / "full"), *per_rank], tmp_path)
    assert full.returncode == 0, full.stderr[-8000:]

    killed = tmp_path / "killed"
    proc = torchrun([*common_args(target, corpus, killed), *per_rank, "--save-every", "3"], tmp_path, wait=False)
    deadline = time.time() + 240
    while not (killed / "checkpoints" / "step-00000003").exists() and time.time() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_until_gone(str(killed))  # torchrun's workers (sessions of their own) die with it
    import shutil

    shutil.rmtree(killed / "checkpoints" / "step-00000006", ignore_errors=True)  # as if killed before step 6
    (killed / "model.safetensors").unlink(missing_ok=True)
    single = tmp_path / "single"
    shutil.copytree(killed, single)
    resumed = torchrun([*common_args(target, corpus, killed), *per_rank, "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-8000:]
    assert main(common_args(target, corpus, single) + ["--batch-size", "2", "--grad-accum", "2", "--resume"]) == 0

    reference = load_file(tmp_path / "full" / "model.safetensors")
    flat = lambda d: torch.cat([d[k].flatten() for k in sorted(d)])  # noqa: E731
    two = load_file(killed / "model.safetensors")
    assert float((flat(two) - flat(reference)).norm()) <= 1e-6 * float(flat(reference).norm())
    one = load_file(single / "model.safetensors")
    assert float((flat(one) - flat(reference)).norm()) <= 1e-5 * float(flat(reference).norm())
    steps = [json.loads(x)["step"] for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6


@pytest.mark.slow  # (two runs of two processes; one process compiled: test_training.py)
def test_torchrun_with_compile_trains_like_eager(tiny_model_factory, tmp_path):
    """``--compile`` under torchrun (the draft's forward and the loss chunks compiled inside the
    DDP-wrapped module; the aot_eager backend, as on a CPU without a compiler): the same losses
    as the uncompiled two-process run."""
    _, target = tiny_model_factory("ddp-llama", "llama", max_position_embeddings=256, seed=5)
    save_char_tokenizer(target)
    corpus = write_corpus(tmp_path / "corpus.jsonl", docs=30)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "LONGSPEC_COMPILE_BACKEND": "aot_eager"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "longspec.cli", *common_args(target, corpus, out), "--batch-size", "1", "--distill", *extra]
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses["eager"]) == 6 and losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
