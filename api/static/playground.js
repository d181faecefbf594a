// tqserve playground: one WebSocket to /v1/stream, one request at a time.
//
// Each token frame becomes a <span class="tok"> whose text is exactly the frame's text,
// with data-token-id, data-logprob and a background tint hsl(120 * p, 70%, 85%) where
// p = exp(logprob): red for unlikely tokens, green for likely ones. Hover (or focus the
// output and use the arrow keys) to see the top alternatives; their text comes from
// GET /playground/vocab.json because token frames carry alternative ids only.
// Every error frame is shown in the alert box, whatever request it answers.
// A server started with --api-key answers the vocabulary with 401: the page then shows a
// key field; the key (kept in sessionStorage, this tab only) goes as a Bearer header on
// fetches and, since a browser cannot set headers on a WebSocket upgrade, as the
// subprotocol "tqserve.bearer.<unpadded base64url of the key>" offered next to "tqserve".
"use strict";

const MAX_HUE = 120;  // the hue of p = 1 (green); p = 0 is hue 0 (red)

/** The tint of a token with this logprob. */
function tintFor(logprob) {
  const p = Math.min(1, Math.max(0, Math.exp(logprob)));
  return `hsl(${Math.round(MAX_HUE * p)}, 70%, 85%)`;
}

/** Whitespace made visible, for token texts shown out of context. */
function visible(text) {
  return text.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

function percent(logprob) {
  const p = 100 * Math.exp(logprob);
  return p >= 10 ? `${p.toFixed(1)}%` : `${p.toPrecision(2)}%`;
}

const $ = (id) => document.getElementById(id);
const ui = {
  form: $("form"), prompt: $("prompt"), maxTokens: $("max-tokens"),
  temperature: $("temperature"), seed: $("seed"), topLogprobs: $("top-logprobs"),
  schema: $("schema"), generate: $("generate"), cancel: $("cancel"), error: $("error"),
  output: $("output"), tooltip: $("tooltip"), connection: $("connection"),
  status: $("status"), model: $("model-name"), keyBox: $("key-box"), key: $("api-key"),
  modeChat: $("mode-chat"),
};
const KEY_STORE = "tqserve-api-key";
const state = {
  socket: null,    // the open WebSocket, or null
  opening: null,   // a promise of the socket while it connects
  nextId: 1,
  current: null,   // {id, sentAt, firstAt, lastAt} of the request on screen, while it runs
  tokens: [],      // per span: {tokenId, text, logprob, top: [[id, logprob], ...]}
  vocab: null,     // token id -> text
  focused: -1,     // index of the token chosen with the keyboard
};

function socketUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/v1/stream`;
}

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

/** Unpadded base64url of the key's UTF-8 bytes: a valid subprotocol token. */
function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let binary = "";
  for (const b of bytes) binary += String.fromCharCode(b);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function socketProtocols() {
  const key = apiKey();
  return key ? ["tqserve", `tqserve.bearer.${base64url(key)}`] : [];
}

function setConnection(open) {
  ui.connection.dataset.state = open ? "open" : "closed";
  ui.connection.textContent = open ? "connected" : "not connected";
}

function openSocket() {
  if (state.socket) return Promise.resolve(state.socket);
  if (state.opening) return state.opening;
  state.opening = new Promise((resolve, reject) => {
    const ws = new WebSocket(socketUrl(), socketProtocols());
    ws.onopen = () => {
      state.socket = ws;
      state.opening = null;
      setConnection(true);
      resolve(ws);
    };
    ws.onmessage = (event) => onFrame(event.data);
    ws.onclose = (event) => {
      setConnection(false);
      if (state.socket !== ws) {  // it never opened
        state.opening = null;
        reject(new Error(`cannot connect to ${socketUrl()} (close code ${event.code})`));
        return;
      }
      state.socket = null;
      if (state.current) {
        showError(`connection closed (code ${event.code}${event.reason ? ": " + event.reason : ""})`);
        finish();
      }
    };
  });
  return state.opening;
}

function showError(text) {
  const line = document.createElement("p");
  line.textContent = text;
  ui.error.append(line);
  ui.error.hidden = false;
}

function clearError() {
  ui.error.replaceChildren();
  ui.error.hidden = true;
}

function setStat(name, value) {
  $(`stat-${name}`).textContent = value === null || value === undefined ? "" : String(value);
}

function onFrame(data) {
  let frame;
  try {
    frame = JSON.parse(data);
  } catch (exc) {
    showError(`unreadable frame from the server: ${exc.message}`);
    return;
  }
  const current = state.current;
  if (frame.type === "error") {
    showError(`${frame.code}: ${frame.message}`);
    if (current && (frame.id === current.id || frame.id === null)) finish();
    return;
  }
  if (!current || frame.id !== current.id) return;  // a request no longer on screen
  if (frame.type === "queued") {
    ui.status.textContent = "queued";
  } else if (frame.type === "token") {
    addToken(frame);
  } else if (frame.type === "done") {
    showDone(frame);
    finish();
  }
}

function addToken(frame) {
  const now = performance.now();
  const current = state.current;
  if (current.firstAt === null) {
    current.firstAt = now;
    setStat("ttft", `${Math.round(now - current.sentAt)} ms`);
  }
  current.lastAt = now;
  const index = state.tokens.length;
  state.tokens.push({tokenId: frame.token_id, text: frame.text, logprob: frame.logprob,
                     top: frame.top_logprobs || []});
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = frame.text;
  span.dataset.index = String(index);
  span.dataset.tokenId = String(frame.token_id);
  if (typeof frame.logprob === "number") {
    span.dataset.logprob = String(frame.logprob);
    span.style.backgroundColor = tintFor(frame.logprob);
  }
  if (frame.text === "") {  // an end-of-text token, or bytes held back for a character
    span.classList.add("empty");
    span.dataset.placeholder = vocabText(frame.token_id);
  } else if (/^\n+$/.test(frame.text)) {  // a line break alone: give it a visible mark
    span.classList.add("newline");
  }
  const atBottom = ui.output.scrollTop + ui.output.clientHeight >= ui.output.scrollHeight - 4;
  ui.output.append(span);
  if (atBottom) ui.output.scrollTop = ui.output.scrollHeight;
}

function showDone(frame) {
  const usage = frame.usage;
  const tiers = Object.entries(usage.cached_tokens_by_tier || {}).filter(([, n]) => n > 0);
  setStat("finish", frame.finish_reason);
  setStat("prompt", usage.prompt_tokens);
  setStat("completion", usage.completion_tokens);
  setStat("cached", usage.cached_tokens);
  setStat("tier", tiers.length ? tiers.map(([tier]) => tier).join(", ") : "none");
  const current = state.current;
  if (current.firstAt !== null && usage.completion_tokens > 1 && current.lastAt > current.firstAt) {
    const rate = (usage.completion_tokens - 1) / ((current.lastAt - current.firstAt) / 1000);
    setStat("rate", rate.toFixed(0));
  }
  ui.status.textContent = `done: ${frame.finish_reason}, ${usage.completion_tokens} tokens`;
}

function finish() {
  state.current = null;
  ui.generate.disabled = false;
  ui.cancel.disabled = true;
  ui.output.setAttribute("aria-busy", "false");
}

function numberField(input) {
  if (input.validity.badInput) throw new Error(`${input.labels[0].textContent} is not a number`);
  return input.value.trim() === "" ? undefined : Number(input.value);
}

/** The generate frame for the form, or an Error naming the field that cannot be sent. */
function buildRequest() {
  const frame = {  // an empty number field is left out: the server's default applies
    type: "generate", id: `playground-${state.nextId++}`, prompt: ui.prompt.value,
    max_tokens: numberField(ui.maxTokens), temperature: numberField(ui.temperature),
    seed: numberField(ui.seed), logprobs: true, top_logprobs: numberField(ui.topLogprobs),
  };
  const schemaText = ui.schema.value.trim();
  if (schemaText !== "") {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (exc) {
      throw new Error(`JSON schema is not valid JSON: ${exc.message}`);
    }
    frame.response_format = {type: "json_schema", json_schema: {schema}};
  }
  return frame;
}

function resetOutput(prompt) {
  hideTip();
  state.tokens = [];
  state.focused = -1;
  const echo = document.createElement("span");
  echo.className = "prompt-echo";
  echo.textContent = prompt;
  ui.output.replaceChildren(echo);
  for (const name of ["finish", "prompt", "completion", "cached", "tier", "ttft", "rate"]) {
    setStat(name, "");
  }
}

async function generate(event) {
  event.preventDefault();
  if (state.current) return;
  if (ui.modeChat.checked) return sendChat();  // playground_chat.js
  clearError();
  let frame;
  try {
    frame = buildRequest();
  } catch (exc) {
    showError(exc.message);
    return;
  }
  resetOutput(frame.prompt);
  state.current = {id: frame.id, sentAt: performance.now(), firstAt: null, lastAt: null};
  ui.generate.disabled = true;
  ui.cancel.disabled = false;
  ui.output.setAttribute("aria-busy", "true");
  ui.status.textContent = "generating";
  try {
    const ws = await openSocket();
    state.current.sentAt = performance.now();
    ws.send(JSON.stringify(frame));
  } catch (exc) {
    showError(exc.message);
    finish();
  }
}

function cancel() {
  if (state.current && state.current.abort) {  // a chat request (playground_chat.js)
    state.current.abort.abort();
    ui.cancel.disabled = true;
    return;
  }
  if (!state.current || !state.socket) return;
  state.socket.send(JSON.stringify({type: "cancel", id: state.current.id}));
  ui.cancel.disabled = true;
}

function vocabText(tokenId) {
  const text = state.vocab ? state.vocab[tokenId] : undefined;
  return text === undefined ? `#${tokenId}` : text;
}

function codeOf(text) {
  const code = document.createElement("code");
  code.textContent = visible(text);
  return code;
}

function showTip(span) {
  const token = state.tokens[Number(span.dataset.index)];
  if (!token) return;
  const head = document.createElement("div");
  head.className = "tip-head";
  head.append(codeOf(token.text === "" ? vocabText(token.tokenId) : token.text));
  if (typeof token.logprob === "number") {
    const p = document.createElement("span");
    p.textContent = `${percent(token.logprob)}  (logprob ${token.logprob.toFixed(3)})`;
    head.append(p);
  }
  const list = document.createElement("ol");
  list.className = "alts";
  for (const [tokenId, logprob] of token.top) {
    const row = document.createElement("li");
    row.className = tokenId === token.tokenId ? "alt chosen" : "alt";
    row.dataset.tokenId = String(tokenId);
    row.dataset.logprob = String(logprob);
    row.dataset.text = vocabText(tokenId);
    const text = codeOf(row.dataset.text);
    text.className = "alt-text";
    const bar = document.createElement("span");
    bar.className = "alt-bar";
    bar.style.width = `${Math.max(1, 100 * Math.exp(logprob))}%`;
    bar.style.backgroundColor = tintFor(logprob);
    const prob = document.createElement("span");
    prob.className = "alt-p";
    prob.textContent = percent(logprob);
    row.append(bar, text, prob);
    list.append(row);
  }
  ui.tooltip.replaceChildren(head);
  if (token.top.length) ui.tooltip.append(list);
  ui.tooltip.hidden = false;
  const rect = span.getBoundingClientRect();
  const width = ui.tooltip.offsetWidth;
  const height = ui.tooltip.offsetHeight;
  const left = Math.max(8, Math.min(rect.left, window.innerWidth - width - 8));
  const below = rect.bottom + 6;
  const top = below + height > window.innerHeight - 8 ? Math.max(8, rect.top - height - 6) : below;
  ui.tooltip.style.left = `${left}px`;
  ui.tooltip.style.top = `${top}px`;
}

function hideTip() {
  ui.tooltip.hidden = true;
}

function focusToken(index) {
  const spans = ui.output.querySelectorAll(".tok");
  if (!spans.length) return;
  const previous = ui.output.querySelector(".tok.focused");
  if (previous) previous.classList.remove("focused");
  state.focused = Math.max(0, Math.min(index, spans.length - 1));
  const span = spans[state.focused];
  span.classList.add("focused");
  span.scrollIntoView({block: "nearest"});
  showTip(span);
}

function onOutputKey(event) {
  const moves = {ArrowRight: state.focused + 1, ArrowLeft: state.focused - 1,
                 Home: 0, End: Infinity};
  if (event.key === "Escape") {
    hideTip();
  } else if (event.key in moves) {
    event.preventDefault();
    focusToken(moves[event.key]);
  }
}

function init() {
  ui.form.addEventListener("submit", generate);
  ui.cancel.addEventListener("click", cancel);
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) ui.form.requestSubmit();
  });
  ui.output.addEventListener("mouseover", (event) => {
    const span = event.target.closest(".tok");
    if (span) showTip(span);
  });
  ui.output.addEventListener("mouseleave", hideTip);
  ui.output.addEventListener("keydown", onOutputKey);
  ui.output.addEventListener("blur", hideTip);
  fetch("/health").then((r) => r.json()).then((health) => {
    ui.model.textContent = health.model;
  }).catch(() => { ui.model.textContent = "unknown"; });
  ui.key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, ui.key.value);
    if (state.socket) state.socket.close(1000);
    connect();
  });
  connect();
}

/** Load the vocabulary (asking for the API key on 401), then open the socket. */
function connect() {
  const key = apiKey();
  const headers = key ? {Authorization: `Bearer ${key}`} : {};
  fetch("/playground/vocab.json", {headers}).then((r) => {
    if (r.status === 401) {
      ui.keyBox.hidden = false;
      throw new Error(key ? "the API key was refused" : "this server needs an API key: enter it above");
    }
    return r.json();
  }).then((vocab) => {
    state.vocab = vocab.tokens;
    if (!ui.keyBox.hidden) clearError();  // the key message, now answered
    return openSocket();
  }).catch((exc) => showError(exc.message));
}

init();
