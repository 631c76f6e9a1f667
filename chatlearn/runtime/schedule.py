"""One rule for everything that happens every N episodes: eval, checkpoints, weight sync."""


def every(n: int | None, episode: int) -> bool:
    """Due after 0-based `episode` when `n` > 0 and `episode + 1` is a multiple of `n` (0 or None: never)."""
    return bool(n) and n > 0 and (episode + 1) % n == 0


def checkpoint_due(interval: int | None, episode: int, num_episode: int) -> bool:
    """Every `interval` episodes, and always after the last one: a finished run leaves a record that a larger
    `num_episode` continues from, and that tells a re-run the run is complete."""
    return every(interval, episode) or episode == num_episode - 1
