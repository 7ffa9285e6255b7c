"""Repository-wide pytest set-up.

Triton kernels run on the CPU through Triton's interpreter in every test run: the variable must be set
before triton is first imported, which is why it lives at the very top of the root conftest.  On a machine
with a GPU, export KVCORE_TEST_COMPILED=1 to run the same tests against compiled kernels instead.
"""

import os

if os.environ.get("KVCORE_TEST_COMPILED") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
