"""The suite derives afresh: the cache of derived estimates on disk (symmem.cache) is off unless
a test turns it on in a directory of its own."""
import os

os.environ["SYMMEM_NO_CACHE"] = "1"
