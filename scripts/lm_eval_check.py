"""lm-evaluation-harness, unmodified, against `leverlab serve`: a loglikelihood task through local-completions
(lm-eval's echo + logprobs requests) and a generation task through local-completions and
local-chat-completions. Prints lm-eval's own result tables; exits non-zero if any run fails.

    python scripts/lm_eval_check.py [--model DIR] [--limit N]

lm-eval goes into its own venv ($LEVERLAB_CACHE/lmeval, default ~/.cache/leverlab/lmeval), never into the
project's: its API models need no torch, and a pip resolve that wanted one could pull a CUDA build over ours.
The install is checked with `pip --dry-run` first and refused if it would install torch. There is no internet
here but package registries, so the two tasks are defined from files this script writes (a YAML task each,
over a JSONL dataset), and the Hugging Face libraries run offline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from server_proc import free_port, stop, wait_ready  # scripts/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = "lm-eval[api]==0.4.13"

# Code completions the bundled model (a 15M code model) can score: each context has one right continuation.
LL_DOCS = [
    {"context": "def add(a, b):\n    return a", "choices": [" + b", " - b", " * c"], "label": 0},
    {"context": "for i in range(10):\n    print(", "choices": ["i)", "]]", "}}"], "label": 0},
    {"context": "import os\nimport", "choices": [" sys", " )", " =="], "label": 0},
    {"context": "class Point:\n    def __init__(self, x, y):\n        self.x =", "choices": [" x", " y(", " ]"],
     "label": 0},
    {"context": "if __name__ == '__main__':\n    ", "choices": ["main()", ")))", "]]]"], "label": 0},
    {"context": "def is_even(n):\n    return n %", "choices": [" 2 == 0", " ) (", " ]["], "label": 0},
]
GEN_DOCS = [
    {"prompt": "def add(a, b):\n    return", "answer": " a + b"},
    {"prompt": "def square(x):\n    return", "answer": " x * x"},
    {"prompt": "for i in range(", "answer": "10):"},
    {"prompt": "import", "answer": " os"},
]

LL_TASK = """task: leverlab_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: leverlab_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def venv_dir() -> Path:
    return Path(os.environ.get("LEVERLAB_CACHE", Path.home() / ".cache" / "leverlab")) / "lmeval"


def ensure_lm_eval() -> Path:
    """lm-eval (and transformers, for its tokenizer backend) in its own venv; refused if torch would come too."""
    venv = venv_dir()
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import lm_eval, transformers"], capture_output=True).returncode == 0:
        return venv
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    import transformers  # the project's version: the same tokenizer code reads the model folder

    wanted = [LM_EVAL, f"transformers=={transformers.__version__}"]
    plan = subprocess.run([str(py), "-m", "pip", "install", "--dry-run", *wanted], capture_output=True, text=True)
    would = next((ln for ln in plan.stdout.splitlines() if ln.startswith("Would install")), "")
    if plan.returncode != 0 or re.search(r"\btorch-", would):
        sys.exit(f"refusing to install {wanted}: pip's plan {'installs torch' if would else 'failed'}:\n"
                 f"{would or plan.stderr[-2000:]}")
    subprocess.run([str(py), "-m", "pip", "install", "-q", *wanted], check=True)
    return venv


def write_tasks(folder: Path) -> None:
    for name, docs, task in (("ll", LL_DOCS, LL_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"leverlab_{name}.yaml").write_text(task.format(data=data))


def run_lm_eval(venv: Path, tasks_dir: Path, out_dir: Path, model_type: str, model_args: str, tasks: str,
                limit: int | None, extra: list[str]) -> int:
    cmd = [str(venv / "bin" / "lm_eval"), "--model", model_type, "--model_args", model_args, "--tasks", tasks,
           "--include_path", str(tasks_dir), "--output_path", str(out_dir), "--log_samples", *extra]
    if limit:
        cmd += ["--limit", str(limit)]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, env=env).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder to serve (default: the bundled model)")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--keep", default=None, help="folder to keep the tasks and lm-eval's outputs in")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from leverlab.config import default_model_path

    model = str(Path(args.model or default_model_path()).resolve())
    venv = ensure_lm_eval()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lm_eval_check-"))
    work.mkdir(parents=True, exist_ok=True)
    write_tasks(work)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "leverlab.cli", "serve", model, "--port", str(port),
                             "--dtype", "float32", "--served-model-name", "leverlab"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    failed = []
    try:
        if not wait_ready(proc, port, timeout=300):
            sys.exit(f"leverlab serve exited with {proc.returncode}" if proc.poll() is not None
                     else "leverlab serve not healthy after 300 s")
        common = "model=leverlab,num_concurrent=1,max_retries=1"
        runs = [
            ("local-completions", f"{common},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                                  f"tokenizer={model}", "leverlab_ll,leverlab_gen", []),
            ("local-chat-completions", f"{common},base_url={url}/v1/chat/completions", "leverlab_gen",
             ["--apply_chat_template"]),
        ]
        for model_type, margs, tasks, extra in runs:
            rc = run_lm_eval(venv, work, work / model_type, model_type, margs, tasks, args.limit, extra)
            if rc != 0:
                failed.append(f"{model_type} ({tasks}): exit {rc}")
    finally:
        stop(proc, grace_s=60)
        log.close()
    print(f"\nlm-eval outputs and the server log: {work}")
    if failed:
        print("FAILED: " + "; ".join(failed))
        return 1
    print("lm-eval ran every task against leverlab serve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
