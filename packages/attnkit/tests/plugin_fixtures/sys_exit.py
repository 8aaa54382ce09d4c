"""A plugin that calls sys.exit() at import (it must be isolated like any broken plugin)."""

import sys

sys.exit("this plugin exits at import")
