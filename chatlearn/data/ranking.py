"""`batch_generation.ranking`: ChatLearn sorts prompts longest-first within each episode-sized chunk.

Generating long prompts together keeps generation batches of similar length (less padding), and sorting only
within a `sample_per_episode` chunk keeps every episode's set of prompts unchanged.

The length measure is ChatLearn's: whitespace-separated words plus CJK characters. A CJK run without spaces
is one "word" *and* each of its characters counts again, so "你好 world" = 2 words ("你好", "world") + 2 CJK
characters = 4; we follow the rule literally rather than trying to avoid that double count.
"""

import re
from collections.abc import Sequence

from chatlearn.data.records import Records

# CJK Unified Ideographs, Extension A, Compatibility Ideographs.
_CJK = re.compile("[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff]")


def prompt_length(text: str) -> int:
    """ChatLearn's prompt length: whitespace words + CJK characters (so unspaced Chinese is not counted as 1)."""
    return len(text.split()) + len(_CJK.findall(text))


def rank_prompts(records: Sequence[dict], sample_per_episode: int, prompt_key: str = "prompt") -> Sequence[dict]:
    """Records reordered longest-prompt-first inside each chunk of `sample_per_episode` (stable; last = remainder).
    A `Records` comes back as a reordered view (its rows are still read only when used), a list as a list."""
    if isinstance(sample_per_episode, bool) or not isinstance(sample_per_episode, int) or sample_per_episode <= 0:
        raise ValueError(f"sample_per_episode must be a positive int, got {sample_per_episode!r}")
    lengths = []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or prompt_key not in record:
            raise ValueError(f"batch_generation.ranking: record {i} has no {prompt_key!r} field")
        text = record[prompt_key]
        if not isinstance(text, str):
            raise TypeError(
                f"batch_generation.ranking: record {i} field {prompt_key!r} is a {type(text).__name__}, expected str"
            )
        lengths.append(prompt_length(text))
    order: list[int] = []
    for start in range(0, len(lengths), sample_per_episode):
        idx = range(start, min(start + sample_per_episode, len(lengths)))
        # sorted() is stable and reverse=True keeps equal elements in their original order.
        order.extend(sorted(idx, key=lambda i: lengths[i], reverse=True))
    if isinstance(records, Records):
        return records.reordered(order)
    return [records[i] for i in order]
