"""Root of the test tree. pytest puts this folder on ``sys.path`` (rootdir conftest, prepend
import mode), so the helpers shared across test folders import as one package, ``support``
(``from support.netns_util import ...``). Child processes (start, stop a process group, free port,
wait until healthy) come from ``pdserve.entrypoints.procs``."""
