// ferroxmp chat page: streams chat over the server's own OpenAI endpoints.
// Everything that comes from the server (model output, errors, names) is put into
// the page with textContent, never as HTML: a reply that contains markup shows it.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "ferroxmp.apiKey";

const chat = {
  model: null,
  messages: [],        // the conversation as sent to /v1/chat/completions
  controller: null,    // AbortController of the reply being streamed
  apiKey: sessionStorage.getItem(KEY_STORAGE) || "",
};

function headers(extra) {
  const h = Object.assign({}, extra);
  if (chat.apiKey) h.Authorization = "Bearer " + chat.apiKey;
  return h;
}

// A request the server refused for the key opens the key dialog; the caller retries.
class KeyNeeded extends Error {}

async function api(path, init) {
  const resp = await fetch(path, Object.assign({}, init, { headers: headers(init && init.headers) }));
  if (resp.status === 401) {
    askForKey(chat.apiKey ? "The server refused this key." : "");
    throw new KeyNeeded("API key needed");
  }
  return resp;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
  } catch (e) { /* not JSON: fall through */ }
  return `HTTP ${resp.status}`;
}

// ---- API key -----------------------------------------------------------------------

function askForKey(message) {
  $("key-error").textContent = message || "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

$("key-form").addEventListener("submit", () => {
  chat.apiKey = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORAGE, chat.apiKey);
  connect();
  pollStats();
});

// ---- model -------------------------------------------------------------------------

async function connect() {
  try {
    const resp = await api("/v1/models");
    if (!resp.ok) throw new Error(await errorText(resp));
    const body = await resp.json();
    chat.model = body.data[0].id;
    $("model").textContent = chat.model;
    $("send").disabled = false;
  } catch (e) {
    if (!(e instanceof KeyNeeded)) $("model").textContent = "server unreachable: " + e.message;
  }
}

// ---- messages ----------------------------------------------------------------------

function addMessage(role, text) {
  const li = document.createElement("li");
  li.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role === "user" ? "You" : (chat.model || "assistant");
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  li.append(who, body, meta);
  $("messages").append(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

// One SSE `data:` payload at a time, as the bytes arrive.
async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

function numberFrom(input, fallback) {
  const v = Number(input.value);
  return input.value === "" || Number.isNaN(v) ? fallback : v;
}

// The figures under a reply; also kept as data-* attributes for tests and tooling.
function showFigures(li, f) {
  Object.assign(li.dataset, {
    tokens: f.tokens, promptTokens: f.promptTokens, cachedTokens: f.cached,
    ttftMs: Math.round(f.ttftMs), finishReason: f.finishReason || "",
  });
  const parts = [`${f.tokens} tokens`];
  if (f.tokensPerS !== null) parts.push(`${f.tokensPerS.toFixed(1)} tok/s`);
  parts.push(`TTFT ${Math.round(f.ttftMs)} ms`);
  parts.push(`${f.cached} of ${f.promptTokens} prompt tokens cached`);
  if (f.finishReason && f.finishReason !== "stop") parts.push(`finish: ${f.finishReason}`);
  li.querySelector(".meta").textContent = parts.join(" · ");
}

async function send(text) {
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const li = addMessage("assistant", "");
  li.classList.add("streaming");
  li.dataset.state = "streaming";
  const body = li.querySelector(".text");
  setBusy(true);
  chat.controller = new AbortController();

  const t0 = performance.now();
  let reply = "", tFirst = null, usage = null, finishReason = null, failure = null;
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      signal: chat.controller.signal,
      body: JSON.stringify({
        model: chat.model, messages: chat.messages, stream: true,
        stream_options: { include_usage: true },
        temperature: numberFrom($("temperature"), 0.7),
        max_tokens: Math.round(numberFrom($("max-tokens"), 256)),
      }),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const data of sseData(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece) {
          if (tFirst === null) tFirst = performance.now();
          reply += piece;
          body.textContent = reply;
          li.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    }
  } catch (e) {
    failure = e.name === "AbortError" ? "stopped" : e.message;
  }
  const tEnd = performance.now();
  chat.controller = null;
  setBusy(false);
  li.classList.remove("streaming");

  if (reply) chat.messages.push({ role: "assistant", content: reply });
  else chat.messages.pop();  // nothing came back: the next message should not follow an unanswered one
  if (usage) {
    const tokens = usage.completion_tokens;
    const decodeS = tFirst === null ? 0 : (tEnd - tFirst) / 1000;
    showFigures(li, {
      tokens, promptTokens: usage.prompt_tokens,
      cached: (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0,
      // Decode speed: the tokens after the first, over the time since the first arrived.
      tokensPerS: tokens > 1 && decodeS > 0 ? (tokens - 1) / decodeS : null,
      ttftMs: (tFirst === null ? tEnd : tFirst) - t0, finishReason,
    });
  }
  if (failure !== null) {
    li.classList.add("error");
    li.querySelector(".meta").textContent = failure;
  }
  li.dataset.state = failure === null ? "done" : "error";
}

function setBusy(busy) {
  $("send").disabled = busy || !chat.model;
  $("stop").disabled = !busy;
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || chat.controller || !chat.model) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => chat.controller && chat.controller.abort());

$("new-chat").addEventListener("click", () => {
  if (chat.controller) chat.controller.abort();
  chat.messages = [];
  $("messages").replaceChildren();
});

// ---- server panel ------------------------------------------------------------------

const STAT_FIELDS = {
  "stat-pages-in-use": "pages_in_use", "stat-pages-cached": "pages_cached", "stat-pages-free": "pages_free",
  "stat-running": "running", "stat-waiting": "waiting",
};

async function pollStats() {
  try {
    const resp = await api("/stats");
    if (!resp.ok) throw new Error(await errorText(resp));
    const s = await resp.json();
    for (const [id, field] of Object.entries(STAT_FIELDS)) $(id).textContent = String(s[field]);
    const total = s.pages_total || 1;
    $("kv-bar").querySelector(".in-use").style.width = `${(100 * s.pages_in_use) / total}%`;
    $("kv-bar").querySelector(".cached").style.width = `${(100 * s.pages_cached) / total}%`;
    $("stats-status").textContent = `${s.pages_total} pages · updated ${new Date().toLocaleTimeString()}`;
    return true;
  } catch (e) {
    $("stats-status").textContent = e instanceof KeyNeeded ? "waiting for the API key" : "offline: " + e.message;
    return false;
  }
}

async function statsLoop() {
  await pollStats();
  setTimeout(statsLoop, 1000);
}

setBusy(false);
connect();
statsLoop();
