// tqserve playground, chat mode (loaded after playground.js, whose ui, state and helpers
// it uses). The conversation goes to POST /v1/chat/completions, streamed: the server
// renders it with the model's chat template, so what the model sees is exactly what an
// OpenAI client would send. The system prompt box leads the messages; the tools box (a
// JSON array of OpenAI function tools) and tool_choice go with them. The transcript shows
// each turn: the user's message, then the assistant's content as tinted token spans
// (class "ctok", data-logprob; chat logprobs name tokens by text), its reasoning, and its
// tool calls (name and JSON arguments) when the model returns them. Each turn is kept in
// the history for the next one; "New chat" clears it. Cancel aborts the fetch.
"use strict";

const chat = {
  history: [],  // the messages sent so far, assistant replies included
  ui: {
    box: $("chat-box"), system: $("system"), tools: $("tools"), toolChoice: $("tool-choice"),
    newChat: $("new-chat"), completion: $("mode-completion"), promptLabel: $("prompt-label"),
  },
};

function chatHeaders() {
  const key = apiKey();
  return key ? {"Content-Type": "application/json", Authorization: `Bearer ${key}`}
    : {"Content-Type": "application/json"};
}

/** The chat request for the form and history, or an Error naming what cannot be sent. */
function chatRequest(text) {
  const messages = [];
  const system = chat.ui.system.value.trim();
  if (system !== "") messages.push({role: "system", content: system});
  messages.push(...chat.history, {role: "user", content: text});
  const top = numberField(ui.topLogprobs);
  const body = {
    messages, max_tokens: numberField(ui.maxTokens), temperature: numberField(ui.temperature),
    seed: numberField(ui.seed), stream: true, stream_options: {include_usage: true},
    logprobs: true, top_logprobs: top,
  };
  const toolsText = chat.ui.tools.value.trim();
  if (toolsText !== "") {
    let tools;
    try {
      tools = JSON.parse(toolsText);
    } catch (exc) {
      throw new Error(`tools is not valid JSON: ${exc.message}`);
    }
    if (!Array.isArray(tools)) throw new Error("tools must be a JSON array");
    body.tools = tools;
    body.tool_choice = chat.ui.toolChoice.value;
  }
  return body;
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  box.dataset.role = role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  if (text) body.textContent = text;
  box.append(who, body);
  const placeholder = ui.output.querySelector(".placeholder, .prompt-echo");
  if (placeholder) ui.output.replaceChildren();
  ui.output.append(box);
  ui.output.scrollTop = ui.output.scrollHeight;
  return body;
}

function addChatText(body, text, entries) {
  const pieces = entries && entries.length ? entries : [{token: text, logprob: null}];
  for (const entry of pieces) {
    const span = document.createElement("span");
    span.className = "ctok";
    span.textContent = entry.token;
    if (typeof entry.logprob === "number") {
      span.dataset.logprob = String(entry.logprob);
      span.style.backgroundColor = tintFor(entry.logprob);
      span.title = (entry.top_logprobs || []).map(
        (t) => `${visible(t.token)}  ${percent(t.logprob)}`).join("\n");
    }
    body.append(span);
  }
}

function addReasoning(body, text) {
  let box = body.querySelector(".reasoning");
  if (!box) {
    box = document.createElement("div");
    box.className = "reasoning";
    body.prepend(box);
  }
  box.textContent += text;
}

function addToolCall(body, call) {
  const box = document.createElement("div");
  box.className = "tool-call";
  box.dataset.name = call.function.name;
  box.dataset.arguments = call.function.arguments;
  const name = document.createElement("code");
  name.className = "tool-name";
  name.textContent = call.function.name;
  const args = document.createElement("code");
  args.className = "tool-args";
  args.textContent = call.function.arguments;
  box.append("tool call ", name, " ", args);
  body.append(box);
}

/** Apply one streamed chunk to the reply; returns the reply's state. */
function onChunk(chunk, reply) {
  if (chunk.error) throw new Error(`${chunk.error.code || chunk.error.type}: ${chunk.error.message}`);
  if (chunk.usage) {
    setStat("prompt", chunk.usage.prompt_tokens);
    setStat("completion", chunk.usage.completion_tokens);
    const cached = (chunk.usage.prompt_tokens_details || {}).cached_tokens || 0;
    setStat("cached", cached);
  }
  for (const choice of chunk.choices || []) {
    const delta = choice.delta || {};
    const now = performance.now();
    if (state.current.firstAt === null && (delta.content || delta.tool_calls)) {
      state.current.firstAt = now;
      setStat("ttft", `${Math.round(now - state.current.sentAt)} ms`);
    }
    if (delta.reasoning_content) addReasoning(reply.body, delta.reasoning_content);
    if (delta.content) {
      reply.content += delta.content;
      addChatText(reply.body, delta.content, choice.logprobs && choice.logprobs.content);
    }
    for (const call of delta.tool_calls || []) {
      reply.calls.push({id: call.id, type: "function", function: call.function});
      addToolCall(reply.body, call);
    }
    if (choice.finish_reason) setStat("finish", choice.finish_reason);
  }
}

async function readStream(response, reply) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {done, value} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: "))
        .map((l) => l.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data !== "") onChunk(JSON.parse(data), reply);
    }
  }
}

async function sendChat() {
  clearError();
  const text = ui.prompt.value;
  let body;
  try {
    body = chatRequest(text);
  } catch (exc) {
    showError(exc.message);
    return;
  }
  hideTip();
  for (const name of ["finish", "prompt", "completion", "cached", "tier", "ttft", "rate"]) {
    setStat(name, "");
  }
  const controller = new AbortController();
  state.current = {id: null, sentAt: performance.now(), firstAt: null, lastAt: null,
                   abort: controller};
  ui.generate.disabled = true;
  ui.cancel.disabled = false;
  ui.output.setAttribute("aria-busy", "true");
  addMessage("user", text);
  const reply = {body: addMessage("assistant"), content: "", calls: []};
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: chatHeaders(), body: JSON.stringify(body),
      signal: controller.signal});
    if (!response.ok) {
      const answer = await response.json().catch(() => ({error: {message: response.statusText}}));
      throw new Error(`${response.status}: ${answer.error.message}`);
    }
    await readStream(response, reply);
    chat.history.push({role: "user", content: text});
    const message = {role: "assistant", content: reply.content || null};
    if (reply.calls.length) message.tool_calls = reply.calls;
    chat.history.push(message);
    ui.status.textContent = "done";
  } catch (exc) {
    if (exc.name === "AbortError") {
      setStat("finish", "cancelled");
    } else {
      showError(exc.message);
    }
  } finally {
    finish();
  }
}

function setMode() {
  const isChat = ui.modeChat.checked;
  chat.ui.box.hidden = !isChat;
  chat.ui.promptLabel.textContent = isChat ? "Message" : "Prompt";
  $("output-title").textContent = isChat ? "Chat" : "Completion";
  ui.schema.disabled = isChat;
}

function newChat() {
  if (state.current) return;
  chat.history = [];
  ui.output.replaceChildren();
  clearError();
}

for (const radio of [ui.modeChat, chat.ui.completion]) {  // a new mode starts afresh
  radio.addEventListener("change", () => { newChat(); setMode(); });
}
chat.ui.newChat.addEventListener("click", newChat);
setMode();
