"""One rule for everything that happens every N episodes: eval, checkpoints, weight sync."""


def every(n: int | None, episode: int) -> bool:
    """Due after 0-based `episode` when `n` > 0 and `episode + 1` is a multiple of `n` (0 or None: never)."""
    return bool(n) and n > 0 and (episode + 1) % n == 0
