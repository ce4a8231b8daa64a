// duplexcache browser client: speaks the OpenAI Realtime protocol (GA event and field shapes) to
// this server's /v1/realtime. Microphone -> AudioWorklet (24 kHz pcm16) -> input_audio_buffer.append;
// response.output_audio.delta (24 kHz pcm16) -> gapless playback; barge-in cancels and truncates.
// No build step: plain script, no dependencies.
"use strict";

const RATE = 24000;            // pcm16 rate both ways (OpenAI's audio/pcm)
const CHUNK_MS = 40;           // microphone chunk per input_audio_buffer.append
const PLAYBACK_LEAD_S = 0.05;  // first buffer after an underrun starts this far ahead (no click)
// Local level detector (barge-in and, without server VAD events, the end of the user's speech).
const VOICE_RMS = 0.02;        // about -34 dBFS
const VOICE_ON_CHUNKS = 3;     // 120 ms above VOICE_RMS = the user is speaking
const VOICE_OFF_CHUNKS = 10;   // 400 ms below it = the user stopped

// What the tests (and a curious person in the console) read.
const duplexStats = {
  connected: false,
  sessionReady: false,
  contextSampleRate: null,
  bytesSent: 0,               // pcm16 bytes sent in input_audio_buffer.append
  chunksSent: 0,
  replySamplesReceived: 0,    // 24 kHz samples in output audio deltas
  replySamplesPlayed: 0,      // samples that actually went out of the speakers
  events: {},                 // server event type -> count
  errors: [],                 // error messages from the server or the page
  latenciesMs: [],            // end of user speech -> first reply audio, one per reply
  bargeIns: 0,
};
window.duplexStats = duplexStats;

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), error: $("error"), apiKey: $("api-key"), voice: $("voice"),
  turnDetection: $("turn-detection"), instructions: $("instructions"), localBargeIn: $("local-barge-in"),
  start: $("start"), stop: $("stop"), reply: $("reply"), level: $("level"), latency: $("latency"), sent: $("sent"),
  played: $("played"), transcript: $("transcript"),
};

let conn = null;  // the live Call, if any

// ------------------------------------------------------------------------------ small helpers

function setStatus(text, kind) {
  ui.status.textContent = text;
  ui.status.className = "status " + kind;
}

function showError(message) {
  duplexStats.errors.push(message);
  ui.error.textContent = message;
  console.error(message);
}

function bytesToBase64(buffer) {
  const bytes = new Uint8Array(buffer);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

function base64ToFloat32(b64) {
  const binary = atob(b64);
  const n = binary.length >> 1;
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    let v = binary.charCodeAt(2 * i) | (binary.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    out[i] = v / 32768;
  }
  return out;
}

function realtimeUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return scheme + "//" + location.host + "/v1/realtime";
}

async function loadVoices() {
  try {
    const resp = await fetch("v1/voices");
    if (!resp.ok) return;
    const body = await resp.json();
    ui.voice.replaceChildren();
    for (const name of body.voices) {
      const opt = document.createElement("option");
      opt.value = opt.textContent = name;
      opt.selected = name === body.default;
      ui.voice.appendChild(opt);
    }
  } catch (err) {
    console.warn("could not list voices", err);
  }
}

// ------------------------------------------------------------------------------ transcript

const transcript = {
  line: null,      // the assistant line the current reply's text goes to
  lastLine: null,  // the previous reply's line (its audio may still be playing)
  addLine(who, text) {
    const p = document.createElement("p");
    p.className = who;
    const tag = document.createElement("b");
    tag.textContent = who === "user" ? "you: " : "model: ";
    const body = document.createElement("span");
    body.textContent = text;
    p.append(tag, body);
    ui.transcript.appendChild(p);
    ui.transcript.scrollTop = ui.transcript.scrollHeight;
    return body;
  },
  append(text) {
    if (!this.line) this.line = this.addLine("assistant", "");
    this.line.textContent += text;
    ui.transcript.scrollTop = ui.transcript.scrollHeight;
  },
  endReply(status) {
    if (this.line && status === "cancelled") this.markInterrupted(this.line);
    this.lastLine = this.line || this.lastLine;
    this.line = null;
  },
  // Playback was cut: the reply being heard is the current one or, when the server already
  // finished sending it, the last one.
  cutPlayback() {
    const line = this.line || this.lastLine;
    if (line) this.markInterrupted(line);
    this.lastLine = this.line || this.lastLine;
    this.line = null;
  },
  markInterrupted(line) {
    if (!line.textContent.endsWith(" [interrupted]")) line.textContent += " [interrupted]";
  },
};

// ------------------------------------------------------------------------------ playback

// Schedules reply deltas back to back on the AudioContext clock; knows how much of the current
// item was heard (for conversation.item.truncate) and stops everything on barge-in.
class Player {
  constructor(ctx) {
    this.ctx = ctx;
    this.nextTime = 0;
    this.segments = [];   // {source, start, samples} of the current item, in order
    this.itemId = null;
  }

  play(pcm, itemId) {
    const ctx = this.ctx;
    if (itemId !== this.itemId) {
      this.segments = [];
      this.itemId = itemId;
    }
    const buffer = ctx.createBuffer(1, pcm.length, RATE);
    buffer.copyToChannel(pcm, 0);
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(ctx.destination);
    const start = Math.max(this.nextTime, ctx.currentTime + PLAYBACK_LEAD_S);
    source.start(start);
    this.nextTime = start + buffer.duration;
    const segment = {source, start, samples: pcm.length, done: false};
    source.onended = () => {
      if (!segment.done) {
        segment.done = true;
        duplexStats.replySamplesPlayed += pcm.length;
      }
      updateReadouts();
    };
    this.segments.push(segment);
    return start;
  }

  // Seconds of the current item heard so far (gaps from underruns are not counted).
  heardSeconds() {
    const now = this.ctx.currentTime;
    let heard = 0;
    for (const s of this.segments) {
      heard += Math.min(Math.max(now - s.start, 0), s.samples / RATE);
    }
    return heard;
  }

  get playing() {
    return this.nextTime > this.ctx.currentTime;
  }

  // Stops all scheduled audio; returns {itemId, playedMs} of what was cut.
  stopAll() {
    const now = this.ctx.currentTime;
    const playedMs = Math.round(this.heardSeconds() * 1000);
    for (const s of this.segments) {
      if (s.done) continue;
      s.done = true;
      duplexStats.replySamplesPlayed += Math.round(Math.min(Math.max(now - s.start, 0), s.samples / RATE) * RATE);
      try { s.source.stop(); } catch (_) { /* not started yet */ }
    }
    const cut = {itemId: this.itemId, playedMs};
    this.segments = [];
    this.nextTime = 0;
    return cut;
  }
}

// ------------------------------------------------------------------------------ one call

class Call {
  constructor(ctx, micStream, ws) {
    this.ctx = ctx;
    this.micStream = micStream;
    this.ws = ws;
    this.player = new Player(ctx);
    this.silenceMs = 500;            // the session's server_vad silence_duration_ms
    this.updateSent = false;
    this.responseActive = false;     // between response.created and response.done
    this.awaitingFirstAudio = false; // the current response has not played audio yet
    this.sentMs = 0;                 // stream position of the next chunk
    this.chunkClock = [];            // [{endMs, wallMs}] of recent chunks, to date a stream position
    this.voice = {on: false, loud: 0, quiet: 0};
    this.speechEndWallMs = null;     // when the user last stopped speaking
    this.speechEndSource = "";
    this.cutItems = new Set();       // items cut by barge-in: their late deltas are not played
  }

  send(event) {
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
  }

  sessionConfig() {
    const turns = {
      duplex: {type: "duplex"},  // duplexcache's own: the model decides every unit
      server_vad: {type: "server_vad", threshold: 0.5, silence_duration_ms: this.silenceMs, prefix_padding_ms: 300},
      none: null,                // the client commits and asks (the Reply button)
    };
    const turn = turns[ui.turnDetection.value];
    return {
      type: "realtime",
      instructions: ui.instructions.value,
      audio: {
        input: {format: {type: "audio/pcm", rate: RATE}, turn_detection: turn},
        output: {format: {type: "audio/pcm", rate: RATE}, voice: ui.voice.value},
      },
    };
  }

  // -------------------------------------------------------------- microphone side

  onMicChunk(pcmBuffer, rms) {
    showLevel(rms);
    const wallMs = performance.now();
    this.trackVoice(rms, wallMs);
    if (!duplexStats.sessionReady) return;  // the session takes audio once its settings are in
    this.send({type: "input_audio_buffer.append", audio: bytesToBase64(pcmBuffer)});
    duplexStats.bytesSent += pcmBuffer.byteLength;
    duplexStats.chunksSent += 1;
    this.sentMs += (pcmBuffer.byteLength / 2) * 1000 / RATE;
    this.chunkClock.push({endMs: this.sentMs, wallMs});
    if (this.chunkClock.length > 1500) this.chunkClock.splice(0, 500);  // about a minute is plenty
    updateReadouts();
  }

  // Wall time (performance.now) at which stream position `ms` was captured.
  wallAtStreamMs(ms) {
    for (const c of this.chunkClock) {
      if (c.endMs >= ms) return c.wallMs - (c.endMs - ms);
    }
    return null;
  }

  trackVoice(rms, wallMs) {
    const v = this.voice;
    if (rms >= VOICE_RMS) {
      v.loud += 1;
      v.quiet = 0;
      if (!v.on && v.loud >= VOICE_ON_CHUNKS) {
        v.on = true;
        if (ui.localBargeIn.checked && this.player.playing) this.bargeIn("local level", true);
      }
    } else {
      v.quiet += 1;
      v.loud = 0;
      if (v.on && v.quiet >= VOICE_OFF_CHUNKS) {
        v.on = false;
        // Server VAD dates the end more precisely; the local guess is for sessions without it.
        if (ui.turnDetection.value !== "server_vad") {
          this.noteSpeechEnd(wallMs - VOICE_OFF_CHUNKS * CHUNK_MS, "local level");
        }
      }
    }
  }

  noteSpeechEnd(wallMs, source) {
    this.speechEndWallMs = wallMs;
    this.speechEndSource = source;
  }

  // The user's turn is over: commit the buffered audio and ask for a reply (turn detection off).
  requestReply() {
    this.noteSpeechEnd(performance.now(), "Reply button");
    this.send({type: "input_audio_buffer.commit"});
    this.send({type: "response.create"});
  }

  // -------------------------------------------------------------- barge-in

  // Stop the reply now. `cancel`: ask the server to stop generating too (a server that saw the
  // speech itself, server_vad's interrupt_response, cancels on its own).
  bargeIn(reason, cancel) {
    if (!this.player.playing && !this.responseActive) return;
    const cut = this.player.stopAll();
    duplexStats.bargeIns += 1;
    console.info("barge-in (" + reason + "): cut item", cut.itemId, "after", cut.playedMs, "ms");
    if (cancel && this.responseActive) this.send({type: "response.cancel"});
    if (cut.itemId) {
      this.cutItems.add(cut.itemId);
      this.send({type: "conversation.item.truncate", item_id: cut.itemId, content_index: 0,
                 audio_end_ms: cut.playedMs});
    }
    transcript.cutPlayback();
  }

  // -------------------------------------------------------------- server events

  onServerEvent(event) {
    const type = event.type;
    duplexStats.events[type] = (duplexStats.events[type] || 0) + 1;
    switch (type) {
      case "session.created":
        if (!this.updateSent) {
          this.updateSent = true;
          this.send({type: "session.update", session: this.sessionConfig()});
        }
        break;
      case "session.updated":
        duplexStats.sessionReady = true;
        setStatus("live", "live");
        break;
      case "input_audio_buffer.speech_started":
        transcript.addLine("user", "(speaking)");
        this.bargeIn("server VAD", false);
        break;
      case "input_audio_buffer.speech_stopped": {
        const wall = this.wallAtStreamMs(event.audio_end_ms - this.silenceMs);
        if (wall !== null) this.noteSpeechEnd(wall, "server VAD");
        break;
      }
      case "response.created":
        this.responseActive = true;
        this.awaitingFirstAudio = true;
        break;
      case "response.output_audio.delta":
      case "response.audio.delta":  // beta name
        this.onAudioDelta(event);
        break;
      case "response.output_audio_transcript.delta":
      case "response.audio_transcript.delta":  // beta name
      case "response.output_text.delta":
        transcript.append(event.delta);
        break;
      case "response.done":
        this.responseActive = false;
        transcript.endReply(event.response && event.response.status);
        break;
      case "error":
        // A cancel that crossed the reply's own end is harmless.
        if (event.error && event.error.code === "response_cancel_not_active") break;
        showError("server: " + (event.error && (event.error.code || event.error.type)) + ": " +
                  (event.error && event.error.message));
        break;
      default:
        break;
    }
  }

  onAudioDelta(event) {
    const pcm = base64ToFloat32(event.delta);
    duplexStats.replySamplesReceived += pcm.length;
    const itemId = event.item_id || event.response_id || null;
    if (itemId && this.cutItems.has(itemId)) return;  // sent before the server saw our cancel
    const startCtxTime = this.player.play(pcm, itemId);
    if (this.awaitingFirstAudio || !this.responseActive) {
      this.awaitingFirstAudio = false;
      this.responseActive = true;
      const firstAudioWall = performance.now() + (startCtxTime - this.ctx.currentTime) * 1000;
      if (this.speechEndWallMs !== null) {
        const ms = Math.round(firstAudioWall - this.speechEndWallMs);
        duplexStats.latenciesMs.push(ms);
        ui.latency.textContent = ms + " ms (" + this.speechEndSource + ")";
        this.speechEndWallMs = null;
      }
    }
  }

  close() {
    try { this.ws.close(1000); } catch (_) { /* already closed */ }
    this.player.stopAll();
    for (const track of this.micStream.getTracks()) track.stop();
    this.ctx.close();
  }
}

// ------------------------------------------------------------------------------ readouts

function showLevel(rms) {
  const db = 20 * Math.log10(Math.max(rms, 1e-6));
  const fraction = Math.min(1, Math.max(0, (db + 60) / 60));  // -60 dBFS .. 0 dBFS
  ui.level.style.width = (fraction * 100).toFixed(1) + "%";
}

function updateReadouts() {
  ui.sent.textContent = (duplexStats.bytesSent / 1024).toFixed(0) + " kB";
  ui.played.textContent = (duplexStats.replySamplesPlayed / RATE).toFixed(1) + " s";
}

// ------------------------------------------------------------------------------ start / stop

// A context at 24 kHz lets the browser do the microphone's resampling; browsers that refuse to
// connect a microphone to a context of another rate get a default-rate context and the worklet
// resamples.
async function openAudio(micStream) {
  let ctx = new AudioContext({sampleRate: RATE, latencyHint: "interactive"});
  let source;
  try {
    source = ctx.createMediaStreamSource(micStream);
  } catch (err) {
    await ctx.close();
    ctx = new AudioContext({latencyHint: "interactive"});
    source = ctx.createMediaStreamSource(micStream);
  }
  await ctx.audioWorklet.addModule("static/capture-worklet.js");
  const node = new AudioWorkletNode(ctx, "capture-processor", {processorOptions: {chunkMs: CHUNK_MS}});
  source.connect(node);
  const mute = ctx.createGain();  // keeps the worklet pulled by the graph without echoing the mic
  mute.gain.value = 0;
  node.connect(mute).connect(ctx.destination);
  await ctx.resume();
  duplexStats.contextSampleRate = ctx.sampleRate;
  return {ctx, node};
}

function openSocket() {
  const key = ui.apiKey.value.trim();
  // Browsers cannot set headers on a WebSocket: the key rides in a subprotocol, as OpenAI's does.
  return key ? new WebSocket(realtimeUrl(), ["realtime", "openai-insecure-api-key." + key])
             : new WebSocket(realtimeUrl());
}

async function start() {
  ui.error.textContent = "";
  if (!window.isSecureContext) {
    showError("the microphone needs a secure page: open it over https or on localhost");
    return;
  }
  ui.start.disabled = true;
  setStatus("connecting", "busy");
  let micStream;
  try {
    micStream = await navigator.mediaDevices.getUserMedia({
      audio: {channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true},
    });
  } catch (err) {
    showError("no microphone: " + err.message);
    setStatus("idle", "idle");
    ui.start.disabled = false;
    return;
  }
  const {ctx, node} = await openAudio(micStream);
  const ws = openSocket();
  const call = new Call(ctx, micStream, ws);
  conn = call;
  node.port.onmessage = (msg) => call.onMicChunk(msg.data.pcm, msg.data.rms);
  ws.onopen = () => { duplexStats.connected = true; };
  ws.onmessage = (msg) => {
    let event;
    try {
      event = JSON.parse(msg.data);
    } catch (err) {
      showError("bad frame from the server: " + err.message);
      return;
    }
    call.onServerEvent(event);
  };
  ws.onclose = (ev) => {
    duplexStats.connected = false;
    duplexStats.sessionReady = false;
    if (!call.updateSent) {  // no session.created on this connection
      // Browsers hide a refused handshake's HTTP status (401/403/429): say what it usually means.
      showError("connection refused before the session started (" + ev.code + "): check the API key; " +
                "the server also refuses other origins and too many connections from one address");
    } else if (ev.code !== 1000 && ev.code !== 1005) {
      showError("connection closed: " + ev.code + " " + ev.reason);
    }
    if (conn === call) stop();
  };
  ui.stop.disabled = false;
  ui.reply.disabled = false;
}

function stop() {
  if (conn) {
    const call = conn;
    conn = null;
    call.close();
  }
  duplexStats.sessionReady = false;
  setStatus("idle", "idle");
  ui.start.disabled = false;
  ui.stop.disabled = true;
  ui.reply.disabled = true;
  showLevel(0);
}

ui.start.addEventListener("click", start);
ui.stop.addEventListener("click", stop);
ui.reply.addEventListener("click", () => { if (conn) conn.requestReply(); });
loadVoices();
