"""lm-evaluation-harness against `iterserve serve`, unchanged: does each kind of task run,
and are its figures the engine's own?

    .venv/bin/python benchmarks/eval_harness/run.py [--model FILE.gguf] [--json PATH]

1. Makes the harness's own venv (`.venv-evals` in the repository root, reused while its
   requirements have not changed) and pip-installs requirements.txt there (pinned, with
   constraints.txt fixing every dependency); never into iterserve's .venv.
2. Writes three small tasks of its own (local JSON lines, no hub): multiple choice with
   two shots (`loglikelihood`), short answers cut at a newline (`generate_until`), and
   passages scored whole (`loglikelihood_rolling`).
3. Starts `iterserve serve` (the bundled model unless --model says otherwise) and runs the
   `lm_eval` command in the harness's venv as a user would: `local-completions` with its
   defaults but four requests in flight and four prompts a request (the tokenizer is the
   server's: lm-eval finds /tokenizer_info and tokenizes through /tokenize), then
   `local-chat-completions --apply_chat_template` on the short answers.
4. Stops the server and recomputes every figure lm-eval logged with the offline engine
   (`LLM`, the same defaults, one process, no HTTP): each continuation's log-probability
   and whether it is greedy, each passage's, each answer's text. A figure is the engine's
   when the two agree (log-probabilities within --atol: the server batches other requests
   beside each one, so its steps are shaped differently).
5. Prints a table and writes JSON (default bench_results/eval_harness.json); fails if a run
   failed, the server answered a 4xx/5xx, or a figure disagrees.

No timing: the figures are agreements. Needs PyPI only to install the harness; neither the
harness nor the server reaches the network (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the modules the scripts share
from _results import write_results  # type: ignore[import-not-found]  # noqa: E402
from _served import (  # type: ignore[import-not-found]  # noqa: E402
    access_statuses,
    ensure_venv,
    free_port,
    get_json,
    installed_versions,
    iterserve_server,
    served_source,
)

PACKAGES = ("lm_eval", "datasets", "requests", "aiohttp", "tenacity")

# ---- the tasks --------------------------------------------------------------------------

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("At what temperature in Celsius does water freeze?", ["100", "50", "0", "-40"], 2),
    ("Which planet is known as the Red Planet?", ["Venus", "Jupiter", "Saturn", "Mars"], 3),
    ("Which gas do plants take in from the air?", ["carbon dioxide", "helium", "neon",
                                                   "argon"], 0),
    ("What is the largest ocean on Earth?", ["Atlantic", "Pacific", "Indian", "Arctic"], 1),
    ("How many days are there in a leap year?", ["365", "364", "366", "360"], 2),
    ("Which animal is known as the king of the jungle?", ["elephant", "tiger", "zebra",
                                                          "lion"], 3),
]  # fmt: skip
ANSWERS = [
    ("What is 2 + 2?", "4"),
    ("What colour is the sky on a clear day?", "blue"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the opposite of hot?", "cold"),
    ("How many hours are there in a day?", "24"),
    ("What do bees make?", "honey"),
]
MAX_GEN_TOKS = 24


@dataclass(frozen=True)
class Run:
    name: str
    model: str  # lm-eval's model type
    tasks: tuple[str, ...]
    model_args: str = ""  # beyond model and base_url
    flags: tuple[str, ...] = ()


RUNS = [
    Run("completions", "local-completions", ("iterserve_mc", "iterserve_gen", "iterserve_ppl"),
        "num_concurrent=4", ("--batch_size", "4")),
    Run("chat", "local-chat-completions", ("iterserve_gen",), "num_concurrent=4",
        ("--apply_chat_template",)),
]  # fmt: skip


# Each task's YAML past its name and data (a file of JSON lines, its test split).
TASK_BODIES = {
    "mc": (
        "output_type: multiple_choice\nnum_fewshot: 2\nfewshot_split: test\n"
        "fewshot_config:\n  sampler: first_n\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    ),
    "gen": (
        "output_type: generate_until\n"
        'doc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: "{{answer}}"\n'
        f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {MAX_GEN_TOKS}\n'
        "  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n"
        "    ignore_punctuation: true\n"
    ),
    "ppl": (
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    ),
}


def write_tasks(where: Path) -> None:
    """The three tasks' data and YAML (iterserve_mc, iterserve_gen, iterserve_ppl), with
    absolute paths to the data."""
    where.mkdir(parents=True, exist_ok=True)
    from iterserve.bench.copy_texts import PASSAGES

    data = {
        "mc": [{"question": q, "choices": c, "label": a} for q, c, a in QUESTIONS],
        "gen": [{"question": q, "answer": a} for q, a in ANSWERS],
        "ppl": [{"text": text} for text in PASSAGES],
    }
    for name, rows in data.items():
        (where / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (where / f"iterserve_{name}.yaml").write_text(
            f"task: iterserve_{name}\ndataset_path: json\ntest_split: test\n"
            f"dataset_kwargs:\n  data_files:\n    test: {where / f'{name}.jsonl'}\n"
            + TASK_BODIES[name]
        )


# ---- one lm_eval run --------------------------------------------------------------------


def run_lm_eval(
    run: Run, python: Path, upstream: str, model: str, tasks_dir: Path, out: Path,
    timeout: float,
) -> dict[str, Any]:  # fmt: skip
    """`lm_eval` as a user runs it; its logged samples by task, its metrics, its exit."""
    endpoint = "chat/completions" if run.model == "local-chat-completions" else "completions"
    model_args = f"model={model},base_url={upstream}/v1/{endpoint}"
    if run.model_args:
        model_args += "," + run.model_args
    command = [
        str(python), "-m", "lm_eval", "--model", run.model, "--model_args", model_args,
        "--tasks", ",".join(run.tasks), "--include_path", str(tasks_dir),
        "--output_path", str(out / run.name), "--log_samples", *run.flags,
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(out / "datasets-cache"),
        "NO_PROXY": "127.0.0.1,localhost",
        "OPENAI_API_KEY": "unused",
    }
    env.pop("PYTHONPATH", None)  # the harness's venv sees nothing of iterserve's
    shutil.rmtree(out / run.name, ignore_errors=True)  # an earlier run's samples
    print("running:", " ".join(command), flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"finished": False, "error": f"timed out after {timeout:.0f} s"}
    result: dict[str, Any] = {
        "finished": done.returncode == 0,
        "exit_code": done.returncode,
        "seconds": round(time.monotonic() - started, 1),  # a guide to the wait only
        "command": command,
    }
    if done.returncode != 0:
        result["stderr_tail"] = done.stderr[-3000:]
        return result
    samples: dict[str, list[dict[str, Any]]] = {}
    metrics: dict[str, Any] = {}
    for path in sorted((out / run.name).rglob("*.json*")):
        if path.name.startswith("samples_"):
            task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
            samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
        elif path.name.startswith("results_"):
            metrics = json.loads(path.read_text())["results"]
    result |= {"samples": samples, "metrics": metrics}
    return result


# ---- the offline engine's figures -------------------------------------------------------


def arguments(sample: dict[str, Any]) -> list[list[Any]]:
    """A logged sample's requests' arguments, in order (lm-eval logs them as gen_args_N:
    {arg_0, arg_1})."""
    args = sample["arguments"]
    keys = sorted(args, key=lambda key: int(key.rsplit("_", 1)[1]))
    return [[args[key][f"arg_{i}"] for i in range(len(args[key]))] for key in keys]


class Reference:
    """The offline engine's answers to what lm-eval asked, tokenized as lm-eval's remote
    tokenizer tokenizes (the served tokenizer, no special tokens added)."""

    def __init__(self, model: str | None) -> None:
        from iterserve import LLM, SamplingParams

        self.llm = LLM(model) if model else LLM()
        self.sampling = SamplingParams
        self.tokenizer = self.llm.engine.tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def scores(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Each continuation's log-probability after its context, and whether each of its
        tokens is the greedy one."""
        params = self.sampling(max_tokens=1, temperature=0, prompt_logprobs=1)
        prompts = [{"prompt_token_ids": context + more} for context, more in pairs]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for (context, more), out in zip(pairs, outputs, strict=True):
            ids = context + more
            total, greedy = 0.0, True
            for i in range(len(context), len(ids)):
                position = out.prompt_logprobs[i]
                total += position[ids[i]].logprob
                best = max(position.values(), key=lambda entry: entry.logprob).logprob
                greedy = greedy and position[ids[i]].logprob >= best
            results.append((total, greedy))
        return results

    def answers(self, prompts: list[Any], until: list[str], chat: bool) -> list[str]:
        params = self.sampling(max_tokens=MAX_GEN_TOKS, temperature=0, stop=until)
        if chat:
            outputs = self.llm.chat(prompts, params, use_tqdm=False)
        else:
            token_prompts = [{"prompt_token_ids": self.encode(p)} for p in prompts]
            outputs = self.llm.generate(token_prompts, params, use_tqdm=False)
        return [out.outputs[0].text for out in outputs]


def check_run(run: Run, result: dict[str, Any], ref: Reference, atol: float) -> dict[str, Any]:
    """Each logged figure of `run` against the offline engine's: counts and the largest
    log-probability gap, by task."""
    checks: dict[str, Any] = {}
    eos = ref.tokenizer.eos_token
    for task, samples in result.get("samples", {}).items():
        if task == "iterserve_gen":
            chat = run.model == "local-chat-completions"
            contexts = [arguments(s)[0][0] for s in samples]
            if chat:  # the messages lm-eval sent, logged as [their JSON]
                contexts = [json.loads(c[0]) for c in contexts]
            until = [s for s in arguments(samples[0])[0][1]["until"]] + [eos]
            theirs = [s["resps"][0][0] for s in samples]
            ours = ref.answers(contexts, until, chat)
            same = [a == b for a, b in zip(theirs, ours, strict=True)]
            checks[task] = {"answers": len(same), "same": sum(same),
                            "differ": [{"served": a, "offline": b}
                                       for a, b, ok in zip(theirs, ours, same, strict=True) if not ok]}  # fmt: skip
            continue
        if task == "iterserve_mc":
            requests = [a for s in samples for a in arguments(s)]
            pairs = [(ref.encode(context), ref.encode(more)) for context, more in requests]
            theirs = [tuple(r[0]) for s in samples for r in s["resps"]]
        else:  # iterserve_ppl: each passage after lm-eval's prefix token, BOS else EOS
            texts = [arguments(s)[0][0] for s in samples]
            prefix = ref.encode(ref.tokenizer.bos_token or eos)
            pairs = [(prefix, ref.encode(text)) for text in texts]
            theirs = [(s["resps"][0][0], None) for s in samples]
        ours = ref.scores(pairs)
        gaps = [abs(float(t[0]) - o[0]) for t, o in zip(theirs, ours, strict=True)]
        greedy_same = [
            t[1] is None or (t[1] == "True") == o[1] for t, o in zip(theirs, ours, strict=True)
        ]
        checks[task] = {"scores": len(gaps), "max_gap": max(gaps),
                        "within_atol": sum(g <= atol for g in gaps),
                        "greedy_flags_same": sum(greedy_same)}  # fmt: skip
    return checks


def agrees(checks: dict[str, Any]) -> bool:
    return all(
        c.get("same", c.get("answers")) == c.get("answers")
        and c.get("within_atol", c.get("scores")) == c.get("scores")
        and c.get("greedy_flags_same", c.get("scores")) == c.get("scores")
        for c in checks.values()
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'run':<12} {'task':<14} {'finished':<9} {'4xx/5xx':<8} agreement with the "
          "offline engine")  # fmt: skip
    for row in rows:
        errors = row["errors"]
        if not row["finished"]:
            print(f"{row['run']:<12} {'-':<14} {'NO':<9} {len(errors):<8} {row.get('error', '')}")
            continue
        for task, c in row["checks"].items():
            if "answers" in c:
                said = f"{c['same']}/{c['answers']} answers the same text"
            else:
                said = (f"{c['within_atol']}/{c['scores']} log-probabilities within atol "
                        f"(largest gap {c['max_gap']:.2e}), greedy flags "
                        f"{c['greedy_flags_same']}/{c['scores']}")  # fmt: skip
            print(f"{row['run']:<12} {task:<14} {'yes':<9} {len(errors):<8} {said}")
    for row in rows:
        for task, metrics in row.get("metrics", {}).items():
            shown = {k: round(v, 4) for k, v in metrics.items()
                     if isinstance(v, float) and "stderr" not in k}  # fmt: skip
            print(f"  {row['run']} {task}: {shown}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-evals",
                        help="the harness's venv (made if missing)")  # fmt: skip
    parser.add_argument("--reinstall", action="store_true", help="pip install again")
    parser.add_argument("--model", default=None, help="served model (default: the bundled one)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more `iterserve serve` argument (repeatable)")  # fmt: skip
    parser.add_argument("--atol", type=float, default=2e-3,
                        help="largest log-probability gap (nats) counted as the same")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per lm_eval run")
    parser.add_argument("--server-wait", type=float, default=1800.0,
                        help="seconds to wait for /health (a cold start compiles kernels)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench_results/eval_harness"),
                        help="lm_eval's outputs, the tasks and the server's log")  # fmt: skip
    parser.add_argument("--json", default="bench_results/eval_harness.json")
    args = parser.parse_args()
    from iterserve.bench.machine import cpu_line  # the kernels the engine's figures come from

    print(cpu_line(), flush=True)
    python = ensure_venv(args.venv.resolve(), HERE, args.reinstall)
    versions = installed_versions(python, PACKAGES)
    out = args.out.resolve()
    tasks_dir = out / "tasks"
    write_tasks(tasks_dir)
    log_path = out / "server.log"
    rows: list[dict[str, Any]] = []
    port = free_port()
    with iterserve_server(port, args.model, args.server_arg, log_path, args.server_wait):
        upstream = f"http://127.0.0.1:{port}"
        model = get_json(f"{upstream}/v1/models")["data"][0]["id"]
        offset = access_statuses(log_path, 0)[1]
        for run in RUNS:
            result = run_lm_eval(run, python, upstream, model, tasks_dir, out, args.timeout)
            time.sleep(1)  # the access lines are written as the responses end
            access, offset = access_statuses(log_path, offset, ("/health",))
            rows.append({"run": run.name, **result, "access": access})
    reference = Reference(args.model)
    for run, row in zip(RUNS, rows, strict=True):
        row["checks"] = check_run(run, row, reference, args.atol) if row["finished"] else {}
        row["agrees"] = row["finished"] and agrees(row["checks"])
        row["errors"] = [a for a in row["access"] if a["status"] >= 400]
        row["passed"] = row["agrees"] and not row["errors"]
        row["requests"] = len(row.pop("access"))
        row.pop("samples", None)  # in lm_eval's own output folder
    print_table(rows)
    results = {
        "benchmark": "eval_harness",
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_line(),
        "model": model,
        "server_args": args.server_arg,
        "iterserve": served_source(),
        "versions": versions,
        "atol": args.atol,
        "runs": rows,
    }
    if args.json:
        write_results(args.json, results)
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
