"""Tenants never share the prefix cache: `--api-key-file` and `cache_salt`.

What it pins down: every client could see every other client's prefix-cache hits
(`usage.prompt_tokens_details.cached_tokens`, and the time to first token). With a
key file, a tenant's requests are salted with its identity; a client's
`cache_salt` narrows sharing further. The oracle is the cache itself: the same
long prompt from the same tenant (and salt) hits, from another tenant (or salt) it
reports 0 cached tokens — and gets the same greedy answer either way.
"""
from __future__ import annotations

import os

import pytest
import requests

from serverproc import ServerProcess, serving

pytestmark = pytest.mark.timeout(180)

KEYS = {"acme": "key-acme-1", "globex": "key-globex-1"}
BARE = "a-bare-key-without-tenant"
PROMPT = "A long shared system prompt about the tenants of a cache, repeated to span pages. " * 6


@pytest.fixture(scope="module")
def tenants(tiny_models, tmp_path_factory):
    path = os.path.join(str(tmp_path_factory.mktemp("keys")), "keys.txt")
    with open(path, "w") as f:
        f.write("# tenants\n" + "".join(f"{t}:{k}\n" for t, k in KEYS.items()) + BARE + "\nacme:key-acme-2\n")
    with serving(tiny_models["llama"], "--page-size", "4", "--kv-pages", "1024", "--api-key-file", path) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_srv(tiny_models):
    with serving(tiny_models["llama"], "--page-size", "4", "--kv-pages", "1024") as srv:
        yield srv


def ask(srv: ServerProcess, key, prompt: str, **extra) -> tuple[str, int]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = requests.post(srv.url + "/v1/completions", headers=headers, timeout=60, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_every_request_needs_one_of_the_keys(tenants):
    for headers in ({}, {"Authorization": "Bearer key-nobody"}, {"Authorization": "Bearer acme:key-acme-1"}):
        r = requests.post(tenants.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers,
                          timeout=30)
        assert r.status_code == 401, r.text


def test_a_tenant_hits_its_own_prefix_and_never_another_tenants(tenants):
    """acme computes the prompt, acme (with either of its keys) hits it; globex and the
    bare key, sending the same prompt after, find nothing cached — same answer."""
    prompt = "tenants: " + PROMPT
    first, cached0 = ask(tenants, KEYS["acme"], prompt)
    assert cached0 == 0
    again, hit = ask(tenants, "key-acme-2", prompt)
    assert hit > 0 and again == first
    other, miss = ask(tenants, KEYS["globex"], prompt)
    assert miss == 0 and other == first
    bare, miss_bare = ask(tenants, BARE, prompt)
    assert miss_bare == 0 and bare == first
    assert ask(tenants, KEYS["globex"], prompt)[1] > 0  # globex's own copy is now cached


def test_a_client_cache_salt_splits_a_tenant_further(tenants):
    prompt = "salted: " + PROMPT
    ask(tenants, KEYS["acme"], prompt, cache_salt="team-a")
    assert ask(tenants, KEYS["acme"], prompt, cache_salt="team-a")[1] > 0
    assert ask(tenants, KEYS["acme"], prompt, cache_salt="team-b")[1] == 0
    assert ask(tenants, KEYS["acme"], prompt)[1] == 0  # no salt: the tenant's own space
    assert ask(tenants, KEYS["globex"], prompt, cache_salt="team-a")[1] == 0  # same salt, other tenant


def test_without_keys_only_the_same_cache_salt_shares(open_srv):
    prompt = "open: " + PROMPT
    text, _ = ask(open_srv, None, prompt)
    assert ask(open_srv, None, prompt)[1] > 0
    salted, miss = ask(open_srv, None, prompt, cache_salt="x")
    assert miss == 0 and salted == text
    assert ask(open_srv, None, prompt, cache_salt="x")[1] > 0
    assert ask(open_srv, None, prompt, cache_salt="y")[1] == 0
