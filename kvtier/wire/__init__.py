"""The wire protocol v1, pure: framing (:mod:`.framing`), per-operation codecs
(:mod:`.codecs`) and flow control shared by both ends (:mod:`.flow_control`).

Imports only :mod:`kvtier.model` and :mod:`kvtier.errors`; never the core,
the tiers, the server, the client or metrics.
"""

from kvtier.wire.codecs import *  # noqa: F403
from kvtier.wire.events import *  # noqa: F403
from kvtier.wire.framing import *  # noqa: F403
from kvtier.wire.hello import *  # noqa: F403
from kvtier.wire.shared import *  # noqa: F403
