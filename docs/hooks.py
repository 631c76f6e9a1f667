"""MkDocs hook: the pages show the benchmarks' plots where the benchmarks write them, bench/results/*.png.

A page links an image as `../../bench/results/NAME.png` (the path from docs/pages/, so the markdown also reads
right in the repository); this hook adds each such file to the site as `results/NAME.png`, so MkDocs resolves
the link and copies the image, and a plot that no longer exists is a broken link in the strict build.
"""

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File(f"../../bench/results/{png.name}", config.docs_dir, config.site_dir,
                          config.use_directory_urls, dest_uri=f"results/{png.name}",
                          inclusion=InclusionLevel.INCLUDED))
    return files
