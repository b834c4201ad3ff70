"""Root of the test tree. pytest puts this folder on ``sys.path`` (rootdir conftest, prepend
import mode), so the helpers shared across test folders import by name: ``stand_util``,
``netns_util``."""
