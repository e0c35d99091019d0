"""stashpoint's benchmarks (benchmarks/README.md).

Importing the package makes sure stashpoint's modules have their bytecode cached, as an
installed package's have (pip compiles them; the peers' under site-packages are). Where
``PYTHONDONTWRITEBYTECODE`` is set, as on some development machines, every fresh process would
otherwise compile the modules it imports from source: 20-40 ms of a restarted process's first
load, timed against peers that pay nothing of the kind. Done once per benchmark run: the
processes it starts inherit the marker.
"""

import os

if not os.environ.get("STASHPOINT_BENCH_COMPILED"):
    import compileall
    from pathlib import Path

    import stashpoint

    compileall.compile_dir(Path(stashpoint.__file__).parent, quiet=1)
    os.environ["STASHPOINT_BENCH_COMPILED"] = "1"
