// What each program accepts, precomputed from the manifest so that a step
// checks its feeds cheaply and names the feed and what was expected.

import { describe, kindOf } from './dtypes.js';

/** One input's check: name, dtype, shape (ints static, strings symbolic, null any). */
export class FeedSpec {
  constructor({ name, dtype, shape }) {
    this.name = name;
    this.dtype = dtype;
    this.shape = shape ?? null;
    this.text = describe(dtype, this.shape);
  }

  /** Throws unless `value` is a tensor of this dtype and shape (`kind` names it in messages). */
  check(value, caller, kind = 'feed') {
    if (value === null || typeof value !== 'object' || typeof value.type !== 'string'
      || !Array.isArray(value.dims) && !ArrayBuffer.isView(value.dims)) {
      throw new TypeError(
        `${caller}: ${kind} '${this.name}' must be an onnxruntime Tensor ` +
        `(new ort.Tensor(type, data, dims)), got ${kindOf(value)}; expected ${this.text}`,
      );
    }
    if (value.type !== this.dtype) {
      throw new TypeError(`${caller}: ${kind} '${this.name}' has dtype ${value.type}, expected ${this.text}`);
    }
    const shape = this.shape;
    if (shape === null) return;
    const dims = Array.from(value.dims);
    if (dims.length !== shape.length || shape.some((d, a) => Number.isInteger(d) && dims[a] !== d)) {
      throw new RangeError(
        `${caller}: ${kind} '${this.name}' has shape [${dims.join(', ')}], expected ${this.text}`,
      );
    }
  }
}

/** A program's inputs: required feeds, optional feeds, state inputs. */
export class ProgramInputs {
  constructor(entry, stateSpecs) {
    this.label = entry.label ?? entry.file;
    this.required = (entry.feeds ?? []).map((f) => new FeedSpec(f));
    this.optional = new Map((entry.optional_feeds ?? []).map((f) => [f.name, new FeedSpec(f)]));
    this.stateInputs = new Set(entry.state_inputs ?? []);
    this.stateSpecs = stateSpecs;
    // Symbolic dimensions shared by several feeds: symbol -> [[feed, axis]]
    // (a batch of 8 inputs and 3 labels must not reach the kernels).
    this.shared = new Map();
    for (const spec of [...this.required, ...this.optional.values()]) {
      (spec.shape ?? []).forEach((d, axis) => {
        if (typeof d === 'string' && d !== '') {
          if (!this.shared.has(d)) this.shared.set(d, []);
          this.shared.get(d).push([spec.name, axis]);
        }
      });
    }
    for (const [symbol, places] of [...this.shared]) if (places.length < 2) this.shared.delete(symbol);
  }

  /** The names a caller may feed this program. */
  names() {
    return [...this.required.map((s) => s.name), ...this.optional.keys()];
  }

  /**
   * The feeds this program reads, checked.  `allowState`: a state variable
   * may be fed to override its value for this call (inference only).
   */
  check(feeds, caller, allowState) {
    const out = {};
    for (const spec of this.required) {
      if (!Object.hasOwn(feeds, spec.name) || feeds[spec.name] === undefined) {
        throw new Error(`${caller}: missing feed '${spec.name}' (input of ${this.label}, expected ${spec.text})`);
      }
      spec.check(feeds[spec.name], caller);
      out[spec.name] = feeds[spec.name];
    }
    for (const [name, spec] of this.optional) {
      if (feeds[name] !== undefined) {
        spec.check(feeds[name], caller);
        out[name] = feeds[name];
      }
    }
    for (const name of this.stateInputs) {
      if (feeds[name] === undefined) continue;
      if (!allowState) {
        throw new Error(`${caller}: '${name}' is a state variable; set it with the session's state, not as a feed`);
      }
      this.stateSpecs.get(name).check(feeds[name], caller);
      out[name] = feeds[name];
    }
    for (const [symbol, places] of this.shared) {
      const sizes = places.filter(([n]) => n in out).map(([n, a]) => [n, a, Number(out[n].dims[a])]);
      if (new Set(sizes.map((s) => s[2])).size > 1) {
        const found = sizes.map(([n, a, v]) => `${n}[${a}]=${v}`).join(', ');
        throw new RangeError(`${caller}: feeds disagree on the symbolic dimension '${symbol}': ${found}`);
      }
    }
    return out;
  }
}

/** Refuse a feeds value that is not an object, or a name no program reads. */
export function checkFeedNames(feeds, known, inputs, caller) {
  if (feeds === null || typeof feeds !== 'object' || Array.isArray(feeds)) {
    throw new TypeError(`${caller}: feeds must be an object of name -> ort.Tensor, got ${kindOf(feeds)}`);
  }
  for (const name of Object.keys(feeds)) {
    if (!known.has(name)) {
      throw new Error(`${caller}: unknown feed '${name}'; the model's inputs are [${[...inputs].sort().map((n) => `'${n}'`).join(', ')}]`);
    }
  }
}
