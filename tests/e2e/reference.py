"""mlx-lm reference runs and the near-tie rule used by the identity tests."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step

# A divergence is accepted only where the reference's top-2 logprob gap at the first
# differing position is below this (float32 batch-shape rounding is ~1e-5 nats).
NEAR_TIE_NATS = 1e-3

PROMPTS = [
    "import os\n",
    "def fib(n):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "for i in range(10):\n",
    "x = [1, 2, 3]\nprint(",
    "# compute the mean of a list\ndef mean(values):\n",
    "import numpy as np\n\n\ndef softmax(x):\n    \"\"\"Return the softmax of x.\"\"\"\n",
    "while True:\n    line = input()\n",
    "try:\n    import json\nexcept ImportError:\n",
    "@property\ndef name(self):\n",
]


def reference(loaded, prompt: str, max_tokens: int):
    """Greedy tokens from mlx_lm's generate_step (plain KVCache), top-2 gaps, log-softmaxes."""
    ids = loaded.tokenizer.encode(prompt)
    tokens, gaps, logprobs = [], [], []
    for token, lp in generate_step(mx.array(ids), loaded.model, max_tokens=max_tokens):
        top2 = mx.sort(lp)[-2:].tolist()
        tokens.append(int(token))
        gaps.append(top2[1] - top2[0])
        logprobs.append(lp)
        if token in loaded.eos_token_ids:
            break
    return tokens, gaps, logprobs


def classify(got: list[int], want: list[int], gaps: list[float]) -> str:
    """'same', or 'near_tie' (proven by the gap rule); raises AssertionError otherwise."""
    if got == want:
        return "same"
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if i < len(gaps) and gaps[i] < NEAR_TIE_NATS and i < min(len(got), len(want)):
        return "near_tie"
    raise AssertionError(
        f"diverged at token {i}: got {got[i:i + 5]}, want {want[i:i + 5]}, "
        f"reference top-2 gap {gaps[i] if i < len(gaps) else None}")
