"""longspec: lossless speculative decoding for long contexts (the LongSpec method).

Commands:
  generate      text from a prompt (the default model and its shipped draft, or --target DIR)
  serve         an OpenAI-compatible server with continuous batching
  train         train a LongSpec draft for a target (torchrun for several GPUs)
  self-distill  chat requests about documents answered by the target (training data for --distill)
  draft-vocab   a copy of a draft that drafts over the most frequent tokens only
  convert       a GGUF checkpoint into a Hugging Face-format directory

`longspec COMMAND --help` lists a command's options. Documentation: docs/ in the repository."""
from __future__ import annotations

import argparse
import sys

from .. import __version__
from .commands import cmd_generate
from .serve_command import cmd_serve
from .train_commands import cmd_convert, cmd_draft_vocab, cmd_self_distill, cmd_train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longspec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"longspec {__version__}")
    # (the commands are listed in the description above: argparse's own list would repeat them)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS)
    parser.commands = sub.choices  # {name: the command's parser}

    gen = sub.add_parser("generate", description="generate text with a target model")
    gen.add_argument("--target", help="HF-format model directory (default: SmolLM2-135M-Instruct, converted once)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1, off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: none)")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object on stdout at the end (text, token_ids, proposer as chosen, tree "
                          "(auto's: the one predicted fastest, as its status line says, null for plain rounds; what "
                          "ran when in stats.trees), auto, stats); the text streamed while generating then goes to "
                          "stderr, with the status lines")
    gen.add_argument("--proposer", choices=["auto", "none", "pld", "streaming", "longspec", "hybrid"],
                     default="auto",
                     help="draft strategy: auto (the default: after every round, plain rounds, prompt lookup's "
                          "chain or the hybrid's trees, whichever measures fastest), none (plain decoding), "
                          "pld (prompt lookup), streaming "
                          "(the target over a StreamingLLM cache, MagicDec), longspec (the LongSpec draft: "
                          "shipped for the default model, --draft DIR for other targets), hybrid (the LongSpec "
                          "draft's beam tree with a prompt-lookup chain merged in)")
    gen.add_argument("--tree", default=None,
                     help="tree shape: 'chain:5', per-depth beam widths '4,16,16,16,16' or static paths "
                          "'[[0],[1],[0,0]]' (default: chain:5 for pld, chain:3 on a CPU; 4,16,16,16,16,1,1,1,1,1 "
                          "for hybrid; 4,16,16,16,16 otherwise)")
    gen.add_argument("--draft", default=None, help="LongSpec draft directory (implies --proposer longspec; "
                                                   "the default model has a shipped draft)")
    gen.add_argument("--window", type=int, default=512, help="recent window of --proposer streaming (default: 512)")
    gen.add_argument("--threads", type=int, default=None,
                     help="CPU threads for PyTorch (default: PyTorch's choice; 1-2 is often fastest on a busy "
                          "small machine)")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    gen.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on GPU)")
    gen.add_argument("--compile", action="store_true",
                     help="on CUDA, also fuse the target's steps through torch.compile (Inductor): each step a little "
                          "faster, but a process pays seconds to load or compile them, which one call rarely wins "
                          "back; the Python API and the server compile by default (default: off, CUDA graphs only)")
    gen.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                     help="split the target over N processes, one per GPU (cuda:0..N-1, NCCL; on the CPU N gloo "
                          "processes): for targets that do not fit one GPU (default: 1)")
    gen.set_defaults(func=cmd_generate)

    sd = sub.add_parser("self-distill", description="chat requests about documents answered by the target (JSONL "
                                             "training data for --distill)")
    sd.add_argument("--target", help="HF-format model directory (default: SmolLM2-135M-Instruct)")
    sd.add_argument("--docs", nargs="+", required=True, help="files / directories of .md .rst .txt .py documents "
                                                             "(not the Python standard library)")
    sd.add_argument("--out", required=True, help="the JSONL file to write")
    sd.add_argument("--tasks", default="summarise,explain,continue,question", help="requests, one per document "
                                                                                   "in turn (default: all four)")
    sd.add_argument("--max-doc-tokens", type=int, default=3072, help="document tokens per request (default: 3072)")
    sd.add_argument("--max-new-tokens", type=int, default=256, help="answer tokens at most (default: 256)")
    sd.add_argument("--batch", type=int, default=8, help="requests answered together (default: 8)")
    sd.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    sd.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default: 0.95)")
    sd.add_argument("--seed", type=int, default=0, help="sampling and document-order seed (default: 0)")
    sd.add_argument("--limit", type=int, default=None, help="at most this many conversations (default: all)")
    sd.add_argument("--shard", default="0/1", help="I/N: answer only every N-th request from the I-th (one process "
                                                   "per GPU, same --seed; default: 0/1, all)")
    sd.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    sd.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    sd.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on GPU)")
    sd.set_defaults(func=cmd_self_distill)

    srv = sub.add_parser("serve", description="an OpenAI-compatible server with continuous batching")
    srv.add_argument("--target", help="HF-format model directory (default: SmolLM2-135M-Instruct, converted once)")
    srv.add_argument("--model-name", default=None, help="the model id clients use (default: the directory name)")
    srv.add_argument("--proposer", choices=["none", "pld", "streaming", "longspec", "hybrid"], default="none",
                     help="draft strategy, as for generate (default: none)")
    srv.add_argument("--tree", default=None, help="tree shape, as for generate")
    srv.add_argument("--draft", default=None, help="LongSpec draft directory (implies --proposer longspec)")
    srv.add_argument("--window", type=int, default=512, help="recent window of --proposer streaming (default: 512)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    srv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default: 8)")
    srv.add_argument("--max-len", type=int, default=4096, help="prompt + new tokens per request (default: 4096)")
    srv.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row at most; then 429 with "
                                                                "Retry-After (default: 64)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds running requests get after SIGTERM; then each ends with an error event (and "
                          "[DONE] when streamed) and the server exits (default: 30)")
    srv.add_argument("--max-body", type=int, default=8 << 20, help="request body bytes at most; then 413 "
                                                                   "(default: 8388608, 8 MiB)")
    srv.add_argument("--api-key", action="append", default=None,
                     help="clients must send 'Authorization: Bearer KEY' (every route but /health); give it "
                          "several times for several tenants, whose prefix caches are kept apart (default: "
                          "$LONGSPEC_API_KEY, keys separated by commas; unset: no key)")
    srv.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    srv.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    srv.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on GPU)")
    srv.add_argument("--buckets", default=None,
                     help="batch sizes a round runs at, comma-separated (default: powers of two up to --max-batch; "
                          "--max-batch is always one); fewer buckets, shorter warm-up, more idle rows computed")
    srv.add_argument("--bucket-trees", default="auto",
                     help="the tree each batch bucket drafts: auto (on CUDA, a cost model measured at start-up picks "
                          "for each bucket of 2 or more rows among trees that fit --tree; needs a draft with an "
                          "acceptance table; a bucket where no tree is predicted faster decodes plainly), off (--tree "
                          "everywhere) or 'B=TREE;B=TREE', e.g. '16=2,2,2' or '16=plain' (default: auto)")
    srv.add_argument("--prefill-chunk", type=int, default=None,
                     help="prefill arriving prompts in fixed-shape chunks of N tokens, a prompt's rest in chunks of N/8, "
                          "N/16 and N/32, each row's and size's captured as a CUDA graph at warm-up (less host work per "
                          "arriving request; a large admission still goes as one batched forward); 0 = always one "
                          "eager prefill (default: 1024 on CUDA, 0 on a CPU)")
    srv.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                     help="prefill every prompt whole (default: requests reuse the K/V of cached prompt prefixes: a "
                          "long document or a chat history is prefilled once)")
    srv.add_argument("--kv-memory", default=None,
                     help="memory of the KV block pool: GiB (e.g. 8 or 8GiB) or a fraction of the memory free at "
                          "start (e.g. 0.9 or 90%%); requests wait for blocks when it is short, cached prefixes are "
                          "evicted least recently used first (default: --max-batch rows of --max-len tokens, on "
                          "CUDA at most half the free memory)")
    srv.add_argument("--no-compile", dest="compile", action="store_false",
                     help="on CUDA, capture the steps as CUDA graphs without fusing them through torch.compile "
                          "(Inductor): a shorter start-up, each step a little slower (default: compiled, the compiled "
                          "code kept under the longspec home for later starts)")
    srv.add_argument("--warm-up", choices=["auto", "on", "off"], default="auto",
                     help="compile and capture every batch bucket's greedy rounds before serving, so no request "
                          "waits for it (default: auto = on CUDA)")
    srv.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                     help="split the target over N processes, one per GPU (cuda:0..N-1, NCCL; on the CPU N gloo "
                          "processes); this process serves HTTP and the others repeat its engine calls. "
                          "--bucket-trees auto keeps --tree in every bucket there (default: 1)")
    srv.add_argument("--log-level", default="warning", help="uvicorn's log level (default: warning)")
    srv.set_defaults(func=cmd_serve)

    dv = sub.add_parser("draft-vocab",
                        description="Writes a copy of a LongSpec draft that scores only the --size most frequent "
                                    "tokens of --data (its training data) when drafting; verification still "
                                    "covers the whole vocabulary, so the output does not change.")
    dv.add_argument("--target", required=True, help="HF-format target model directory")
    dv.add_argument("--draft", required=True, help="draft directory")
    dv.add_argument("--data", required=True, nargs="+", help="text / JSONL files or source trees (the training data)")
    dv.add_argument("--size", type=int, default=8192, help="tokens kept (default: 8192)")
    dv.add_argument("--out", required=True, help="output draft directory (new, empty or a longspec draft)")
    dv.add_argument("--force", action="store_true",
                    help="write into an --out folder that holds other files (never an input's folder)")
    dv.set_defaults(func=cmd_draft_vocab)

    conv = sub.add_parser("convert", description="convert a GGUF checkpoint to an HF-format directory")
    conv.add_argument("--gguf", required=True, help="input .gguf file")
    conv.add_argument("--out", required=True, help="output directory (new, empty or an earlier conversion, which "
                                                    "is replaced)")
    conv.add_argument("--force", action="store_true",
                      help="write into an --out folder that holds other files (never an input's folder)")
    conv.add_argument("--dtype", default="float32")
    conv.add_argument("--tokenizer", metavar="DIR",
                      help="a folder of the model's tokenizer files to use instead of rebuilding it from the GGUF")
    conv.set_defaults(func=cmd_convert)

    tr = sub.add_parser("train",
                        description="Trains a LongSpec draft. Data parallel: torchrun --nproc_per_node N "
                                    "-m longspec.cli train ...")
    tr.add_argument("--target", required=True, help="HF-format target model directory (frozen)")
    tr.add_argument("--data", required=True, nargs="+",
                    help="text files, JSONL files (--text-field) and/or source-tree directories")
    tr.add_argument("--out", required=True, help="output directory: a draft loadable with load_draft")
    tr.add_argument("--seq-len", type=int, default=2048, help="tokens per training chunk")
    tr.add_argument("--batch-size", type=int, default=1, help="chunks per micro-batch per process")
    tr.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    tr.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    tr.add_argument("--lr", type=float, default=3e-4)
    tr.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, relative to --lr")
    tr.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    tr.add_argument("--window", type=int, default=512, help="draft self-attention window")
    tr.add_argument("--max-lag", type=int, default=None,
                    help="noisy cross-attention lags 1..G (default: the depth of --tree, 5 for the default beam tree)")
    tr.add_argument("--tree", default="4,16,16,16,16", help="the tree shape the draft will draft (default: 4,16,16,16,16)")
    tr.add_argument("--no-anchor-offset", action="store_true", help="plain positions 0..n-1 (ablation)")
    tr.add_argument("--no-noise", action="store_true", help="lag 1 always (ablation)")
    tr.add_argument("--distill", action="store_true", help="add KL(target || draft) to the loss")
    tr.add_argument("--distill-weight", type=float, default=1.0,
                    help="with --distill: loss = (1-w) CE + w KL (default 1: pure distillation)")
    tr.add_argument("--intermediate-size", type=int, default=None,
                    help="the draft MLP's width (default: the target's)")
    tr.add_argument("--init-from", default=None, metavar="DRAFT_DIR",
                    help="start from this draft's weights (fine-tune a trained or published draft on your data)")
    tr.add_argument("--text-field", default="text", help="text field of JSONL records")
    tr.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
    tr.add_argument("--eval-fraction", type=float, default=0.05, help="share of documents held out")
    tr.add_argument("--exclude", nargs="+", default=[], metavar="PATTERN",
                    help="glob patterns of top-level entries of source-tree --data to leave out (e.g. the packages "
                         "you evaluate on: --data SITE --exclude transformers 'rich*')")
    tr.add_argument("--data-cache", default=None,
                    help="directory keeping the tokenised data, keyed by the documents, settings and tokenizer: "
                         "later runs on the same data skip tokenising")
    tr.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations")
    tr.add_argument("--eval-chunks", type=int, default=64,
                    help="held-out chunks per evaluation, spread over the held-out set (0: all)")
    tr.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    tr.add_argument("--log-every", type=int, default=10, help="steps per metrics.jsonl row")
    tr.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    tr.add_argument("--force", action="store_true",
                    help="write into an --out folder that holds other files (never an input's folder)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", default=None, help="cpu, cuda ... (default: cuda if available)")
    tr.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    tr.add_argument("--no-progress", action="store_true",
                    help="no progress bars: lines on stderr instead (a line per logged step, tokenizing at most "
                         "every 10 s)")
    tr.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                    help="the draft's forward and backward and the loss chunks through torch.compile (Inductor): "
                         "about 1.8x the tokens/s on a GPU with --distill (default: auto = on CUDA)")
    tr.set_defaults(func=cmd_train)
    return parser


def use_compile_caches() -> None:
    """Compiled code is kept on disk under the longspec home (``compile/``: Inductor's graphs and
    kernels, Triton's kernels) unless the environment names other folders, so a second process
    loads what the first compiled instead of compiling it again."""
    import os

    from ..convert import home_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home_dir() / "compile" / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(home_dir() / "compile" / "triton"))


def main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (argparse would name them with the top-level usage: the command's is the useful one)
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        use_compile_caches()
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        print("\n[longspec: interrupted]", file=sys.stderr)
        return 130
    except UnicodeDecodeError as err:  # (a ValueError): a file that is not text, named where we know it
        print(f"error: {err.reason} at byte {err.start} (a file that is not UTF-8 text?)", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as err:  # UsageError is a ValueError; OSError names its file
        print(f"error: {err}", file=sys.stderr)
        return 2

