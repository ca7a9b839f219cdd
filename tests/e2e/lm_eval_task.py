"""A small lm-evaluation-harness task written on the spot from ShareGPT text (no hub
access): multiple-choice questions scored by loglikelihood, and the same questions
answered by generate_until. Used by tests/e2e/test_serve_openai.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

from pdserve.sharegpt import sample_prompts

MC_TASK = "pdserve_sharegpt_mc"
GEN_TASK = "pdserve_sharegpt_gen"


def write_tasks(root: Path, n: int = 6, seed: int = 0) -> Path:
    """Write n questions as JSONL and the two task YAMLs under ``root``; returns it
    (the TaskManager's include_path). Each question quotes a ShareGPT prompt and asks
    which of four words it contains: one from the text, three from other prompts."""
    rng = random.Random(seed)
    texts = sample_prompts(4 * n, max_chars=240, min_chars=60)
    words = [[w.strip(".,!?:;\"'()").lower() for w in t.split()] for t in texts]
    words = [[w for w in ws if w.isalpha() and len(w) > 3] for ws in words]
    rows = []
    for i in range(n):
        own = rng.choice(words[i])
        others = [w for ws in words[n:] for w in ws if w not in words[i]]
        choices = [own] + rng.sample(sorted(set(others)), 3)
        rng.shuffle(choices)
        rows.append({"question": f"Text: {texts[i]}\nQuestion: which word appears in the "
                                 f"text: {', '.join(choices)}?\nAnswer:",
                     "choices": [f" {c}" for c in choices], "answer": choices.index(own)})
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\ndoc_to_text: \"{{question}}\"\n")
    (root / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n{common}output_type: multiple_choice\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    (root / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n{common}output_type: generate_until\n"
        "doc_to_target: \"{{choices[answer]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return root
