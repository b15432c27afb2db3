// The /kv page: polls /kv/state (one request in flight, at most every POLL_MS) and draws one cell per
// block on the canvas; when the pool has more blocks than the canvas has pixels, each pixel stands for
// a run of consecutive blocks and shows their average colour.
"use strict";
(() => {
  const POLL_MS = 250;
  const HIDDEN_POLL_MS = 2000;
  const MAX_CELL = 24;
  // State bytes: 0 free, 1 free but cached, 2 in use by one sequence, k + 1 shared by k.
  const FREE = [228, 228, 228], CACHED = [150, 196, 230], ONE = [49, 163, 84];
  const SHARED = [[253, 174, 97], [244, 109, 67], [215, 48, 39], [165, 0, 38]];  // k = 2, 3, 4-7, 8+
  const colour = (s) => s === 0 ? FREE : s === 1 ? CACHED : s === 2 ? ONE
    : SHARED[s === 3 ? 0 : s === 4 ? 1 : s < 9 ? 2 : 3];

  const canvas = document.getElementById("canvas");
  const ctx = canvas.getContext("2d");
  const tip = document.getElementById("tip");
  const keyForm = document.getElementById("keyform");
  const keyInput = document.getElementById("key");
  let apiKey = new URLSearchParams(location.hash.slice(1)).get("key") || sessionStorage.getItem("pagellm-key") || "";
  const view = { state: null, states: null, owners: null, layout: null, polls: 0, draws: 0, drawnAt: null };
  window.kvMap = view;  // for tests and the curious

  document.getElementById("legend").innerHTML = [
    [FREE, "free"], [CACHED, "free, cached prefix"], [ONE, "used by one sequence"],
    [SHARED[0], "shared by 2"], [SHARED[1], "shared by 3"], [SHARED[2], "shared by 4–7"], [SHARED[3], "shared by 8+"],
  ].map(([c, label]) => `<div><span class="swatch" style="background:rgb(${c})"></span>${label}</div>`).join("");

  function decode(b64, Type) {
    const bin = atob(b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return new Type(bytes.buffer);
  }

  function layoutFor(n, width, height) {
    const side = Math.floor(Math.sqrt((width * height) / Math.max(n, 1)));
    if (side >= 1) {
      const cell = Math.min(side, MAX_CELL);
      let cols = Math.max(1, Math.floor(width / cell));
      return { cell, cols, rows: Math.ceil(n / cols), perCell: 1 };
    }
    const perCell = Math.ceil(n / (width * height));  // more blocks than pixels: aggregate runs
    const cells = Math.ceil(n / perCell);
    return { cell: 1, cols: width, rows: Math.ceil(cells / width), perCell };
  }

  function draw() {
    const { states } = view;
    if (!states) return;
    const started = performance.now();
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.floor(canvas.clientWidth * dpr));
    const height = Math.max(1, Math.floor(canvas.clientHeight * dpr));
    if (canvas.width !== width || canvas.height !== height) { canvas.width = width; canvas.height = height; }
    const layout = view.layout = layoutFor(states.length, width, height);
    const image = ctx.createImageData(width, height);
    const px = image.data;
    const gap = layout.cell >= 6 ? 1 : 0;
    const cells = Math.ceil(states.length / layout.perCell);
    for (let i = 0; i < cells; i++) {
      let rgb;
      if (layout.perCell === 1) {
        rgb = colour(states[i]);
      } else {
        const sum = [0, 0, 0], from = i * layout.perCell, to = Math.min(states.length, from + layout.perCell);
        for (let b = from; b < to; b++) { const c = colour(states[b]); sum[0] += c[0]; sum[1] += c[1]; sum[2] += c[2]; }
        rgb = sum.map((v) => v / (to - from));
      }
      const x0 = (i % layout.cols) * layout.cell, y0 = Math.floor(i / layout.cols) * layout.cell;
      for (let y = y0; y < Math.min(height, y0 + layout.cell - gap); y++) {
        let p = (y * width + x0) * 4;
        for (let x = 0; x < layout.cell - gap && x0 + x < width; x++, p += 4) {
          px[p] = rgb[0]; px[p + 1] = rgb[1]; px[p + 2] = rgb[2]; px[p + 3] = 255;
        }
      }
    }
    ctx.putImageData(image, 0, 0);
    view.draws++;
    view.drawMs = performance.now() - started;
    view.drawnAt = view.state.taken_at;
  }

  const fmt = (n) => n.toLocaleString("en-US");
  function show(state) {
    const set = (id, text) => { document.getElementById(id).textContent = text; };
    for (const id of ["used_blocks", "cached_blocks", "free_blocks", "shared_blocks", "cow_copies", "preemptions",
                      "running", "waiting"]) set(id, fmt(state[id]));
    set("waste", `${fmt(state.waste_slots)} slots (${(100 * state.waste).toFixed(1)}%)`);
    set("pool", `${fmt(state.num_blocks)} × ${state.block_size} tokens`);
    const when = new Date(state.taken_at * 1000).toLocaleTimeString();
    set("status", `updated ${when} · snapshot ${state.snapshot_ms.toFixed(2)} ms`);
  }

  function describe(index) {
    const { states, owners, layout, state } = view;
    const from = index * layout.perCell, to = Math.min(states.length, from + layout.perCell);
    if (from >= states.length) return null;
    if (to - from === 1) {
      const s = states[from];
      const what = s === 0 ? "free" : s === 1 ? "free, holds a cached prefix" : s === 2 ? "used by one sequence"
        : `shared by ${s === 255 ? "254+" : s - 1} sequences`;
      const name = state.owner_ids[owners[from]];
      const owner = name ? ` · ${name}` : "";
      return `block ${from}: ${what}${owner}`;
    }
    let used = 0, shared = 0, cached = 0;
    const requests = new Set();
    for (let b = from; b < to; b++) {
      if (states[b] >= 2) used++;
      if (states[b] >= 3) shared++;
      if (states[b] === 1) cached++;
      const name = state.owner_ids[owners[b]];
      if (name) requests.add(name);
    }
    const names = [...requests].slice(0, 3).join(", ") + (requests.size > 3 ? ", …" : "");
    return `blocks ${from}–${to - 1}: ${used} used (${shared} shared), ${cached} cached` + (names ? ` · ${names}` : "");
  }

  canvas.addEventListener("mousemove", (event) => {
    if (!view.layout) return;
    const dpr = window.devicePixelRatio || 1;
    const rect = canvas.getBoundingClientRect();
    const x = Math.floor(((event.clientX - rect.left) * dpr) / view.layout.cell);
    const y = Math.floor(((event.clientY - rect.top) * dpr) / view.layout.cell);
    const text = x < view.layout.cols ? describe(y * view.layout.cols + x) : null;
    tip.style.display = text ? "block" : "none";
    if (text) {
      tip.textContent = text;
      tip.style.left = `${event.clientX - rect.left + 24}px`;
      tip.style.top = `${event.clientY - rect.top + 14}px`;
    }
  });
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  window.addEventListener("resize", draw);
  keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey = keyInput.value;
    sessionStorage.setItem("pagellm-key", apiKey);
    keyForm.hidden = true;
  });

  async function poll() {
    try {
      const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
      const response = await fetch("/kv/state", { headers, cache: "no-store" });
      if (response.status === 401) {
        keyForm.hidden = false;
        document.getElementById("status").textContent = "this server needs its API key";
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const state = await response.json();
      view.polls++;
      if (!view.state || state.taken_at !== view.state.taken_at) {
        view.state = state;
        view.states = decode(state.states, Uint8Array);
        view.owners = decode(state.owners, Int32Array);
        show(state);
        draw();
      }
    } catch (error) {
      document.getElementById("status").textContent = `no data: ${error.message}`;
    } finally {
      setTimeout(poll, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
    }
  }
  poll();
})();
