"""pagellm's log output: INFO and above to stderr, as vLLM prints its start-up and preemption lines.

Set PAGELLM_CONFIGURE_LOGGING=0 to leave logging entirely to the application.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_logging() -> None:
    if os.environ.get("PAGELLM_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("pagellm")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("PAGELLM_LOGGING_LEVEL", "INFO").upper())
    # Records stop at this handler; an application's root handlers would print them twice.
    logger.propagate = False
