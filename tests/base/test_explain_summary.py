"""``explain``'s per-architecture summary says each cause in words a person reads (no reason template
with its numbers stripped) and gives one real reason of that cause as its example."""

from __future__ import annotations

import re

import pytest
from test_arch_check import gpu, problem

from superlinear_ops.arch_check import CAUSES, summary
from superlinear_ops.cli import main
from superlinear_ops.problem import ATTENTION_LAYER, SPAN_BACKWARD, SPAN_FORWARD, STAGED_DECODE
from superlinear_ops.registry import REGISTRY

PLAIN = {words for _, words in CAUSES}
LINE = re.compile(r"^  (\d+): ((?:(?:window|span) part: )?(.+)); e\.g\. (.+)$")


@pytest.mark.parametrize("arch", ["sm_80", "sm_86"])
@pytest.mark.parametrize("op", [SPAN_FORWARD, SPAN_BACKWARD, STAGED_DECODE, ATTENTION_LAYER])
def test_each_cause_in_plain_words_with_one_real_example(op: str, arch: str) -> None:
    p = problem(gpu(arch), op=op)
    if op == STAGED_DECODE:
        p = p._replace(queries=1, keys=65536, factors=(3.0, 1.0, 0.55))
    summaries = 0
    for variant in REGISTRY.variants(op):
        lines = summary(variant, p)
        if not lines:
            continue
        summaries += 1
        reasons = {reason.split(" (compiled")[0] for _, reason in variant.unrunnable(p)}
        counted = 0
        for line in lines[1:]:
            match = LINE.match(line)
            assert match, f"{variant.name}: {line}"
            count, _, words, example = match.groups()
            assert words in PLAIN, f"{variant.name}: not a cause in plain words: {line}"
            assert example in reasons, f"{variant.name}: the example is no real reason: {line}"
            counted += int(count)
        assert lines[0].startswith(f"{counted} of ") and f"cannot run on {arch}" in lines[0]
    assert summaries >= 1


def test_explain_prints_the_plain_summary(capsys) -> None:
    assert main(["explain", "--arch", "sm_86"]) == 0
    shown = capsys.readouterr().out
    assert "its tiles would need more shared memory than a thread block has; e.g. shared memory: about" in shown
    assert "registers: about values per thread" not in shown and "(limit, e.g." not in shown
