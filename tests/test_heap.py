"""heap.release_library_pages: a library's clean pages leave the resident set, and come
back unchanged when used.

The oracle is the kernel's own count (/proc/self/smaps `Rss:` of the library's
mappings) and the library's answer before and after. The library is built here and
loaded from a private path, so no other process maps its pages (the kernel keeps a page
another process maps, which a shared library in a parallel test run would be).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

BLOB_MB = 8

LIBRARY = f"""
const unsigned char blob[{BLOB_MB} << 20] = {{1, 2, 3}};  /* const: .rodata, the file's own pages */
unsigned long blob_sum(void) {{
    const volatile unsigned char *p = blob;  /* volatile: the compiler cannot fold the sum */
    unsigned long s = 0;
    for (unsigned long i = 0; i < sizeof blob; i += 4096) s += p[i] + i % 251;
    return s;
}}
"""

PROBE = """
import ctypes, json, sys
from ferroxmp.heap import release_library_pages

path = sys.argv[1]

def resident_kb():
    kb, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and all(c in "0123456789abcdef-" for c in first):
                ours = line.rstrip().endswith(path)
            elif ours and line.startswith("Rss:"):
                kb += int(line.split()[1])
    return kb

import mmap
probe = mmap.mmap(-1, 4096)  # does this kernel take MADV_PAGEOUT at all? (5.4+, not every sandbox)
libc = ctypes.CDLL("libc.so.6", use_errno=True)
addr = ctypes.addressof(ctypes.c_char.from_buffer(probe))
supported = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(4096), 21) == 0
lib = ctypes.CDLL(path)
lib.blob_sum.restype = ctypes.c_ulong
before = lib.blob_sum()
touched = resident_kb()
advised = release_library_pages()
released = resident_kb()
after = lib.blob_sum()
print(json.dumps({"before": before, "after": after, "touched": touched, "released": released,
                  "again": resident_kb(), "advised": advised, "supported": supported}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT) and /proc are Linux's")
def test_a_library_touched_at_start_leaves_the_resident_set_and_answers_the_same(tmp_path):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (the fused kernels need one too)"
    src = tmp_path / "blob.c"
    src.write_text(LIBRARY)
    lib = tmp_path / "libblob.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), str(lib)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    import json
    r = json.loads(run.stdout)
    assert r["touched"] >= BLOB_MB * 1024 * 0.9, r  # the sum read every page of the blob
    if not r["supported"]:
        pytest.skip("this kernel refuses madvise(MADV_PAGEOUT) (before Linux 5.4, or a sandbox): a no-op here")
    assert r["advised"] >= BLOB_MB << 20, r
    assert r["released"] <= r["touched"] * 0.1, r  # gone from the resident set
    assert r["after"] == r["before"], r  # and read back from the file unchanged
    assert r["again"] >= BLOB_MB * 1024 * 0.9, r
