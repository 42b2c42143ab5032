// Reads a Chrome trace (JSON) with Chrome DevTools' trace engine, the parser behind the
// Performance panel, and prints what it made of it as JSON on one line: the trace's bounds and,
// per process and thread, the name it gave the thread and every entry it drew
// ([category, name, ts_us, dur_us]). Usage: node parse.mjs TRACE.json
import fs from 'node:fs';
import * as Trace from '@paulirish/trace_engine';

// The engine measures with the browser's DOMRect, which Node lacks.
globalThis.DOMRect ??= class DOMRect {
  constructor(x = 0, y = 0, width = 0, height = 0) {
    Object.assign(this, {x, y, width, height});
  }
};

const doc = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const model = Trace.TraceModel.Model.createWithAllHandlers();
await model.parse(Array.isArray(doc) ? doc : doc.traceEvents);
const data = model.parsedTrace().data;
const threads = [];
for (const [pid, process] of data.Renderer.processes) {
  for (const [tid, thread] of process.threads) {
    threads.push({
      pid, tid, name: thread.name ?? null,
      entries: thread.entries.map(e => [e.cat, e.name, e.ts, e.dur ?? 0]),
    });
  }
}
console.log(JSON.stringify({bounds_us: data.Meta.traceBounds, threads}));
