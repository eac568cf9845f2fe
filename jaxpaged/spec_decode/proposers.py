"""Former home of the proposers, kept so that older imports work: use `jaxpaged.spec_decode`."""

from jaxpaged.spec_decode import *  # noqa: F401,F403
from jaxpaged.spec_decode import __all__  # noqa: F401
