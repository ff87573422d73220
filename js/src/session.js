// TrainingSession: trains a portable training bundle (docs/bundle.md) on the
// onnxruntime module the caller passes: onnxruntime-node, onnxruntime-web or
// onnxruntime-react-native.  This module has no import of node: modules; the
// Node entry (node.js) adds folders on disk and save().

import { bytesOf, describe, elementType, sizeOf } from './dtypes.js';
import { FeedSpec, ProgramInputs, checkFeedNames } from './feeds.js';
import { fit } from './fit.js';
import { bundleFiles, parseManifest } from './manifest.js';
import { MissingFile, bytesReader, decodeUtf8, encodeUtf8, urlReader } from './sources.js';

/** This package's version (package.json's). */
export const VERSION = '0.1.0';

/** One program of the bundle: its manifest entry, its input checks, its onnxruntime session. */
class Program {
  constructor(entry, label, stateSpecs) {
    this.entry = entry;
    this.file = entry.file;
    this.label = label;
    this.inputs = new ProgramInputs({ ...entry, label }, stateSpecs);
    this.session = null; // created on first use, or by load for the programs a step runs
  }
}

/** Where a failure happened, Python's way: training_info[0].update_binding[3]. */
function bindingPlace(label, field, index) {
  const owner = label.includes('.') ? label.slice(0, label.lastIndexOf('.')) : label;
  return `${owner}.${field}[${index}]`;
}

function sameShape(dims, shape) {
  return dims.length === shape.length && shape.every((d, i) => Number(dims[i]) === d);
}

export class TrainingSession {
  #ort;
  #manifest;
  #reader;
  #kept; // name -> bytes of the files read at load (sources that cannot be read again)
  #stateSpecs; // name -> FeedSpec (dtype, shape) of every state variable
  #state; // name -> ort.Tensor, replaced (never written) by a commit
  #inference;
  #algorithms;
  #initializations;
  #knownFeeds;
  #inputNames;
  #sessionOptions;
  #tail = Promise.resolve(); // steps, runs and saves take turns
  #position;
  #positionSource;

  /**
   * Load a bundle.  `source`: a base URL (absolute or relative to the page;
   * the trailing slash is optional), or an object of the bundle's files as
   * bytes ({ 'manifest.json': ..., 'state.bin': Uint8Array, ... }); the Node
   * entry also takes a folder path.  `options.sessionOptions` go to every
   * ort.InferenceSession.create; `options.fetch` replaces the global fetch.
   */
  static async load(ort, source, options = {}) {
    checkOrt(ort);
    const reader = await this.readerFor(source, options);
    return this.fromReader(ort, reader, options);
  }

  /** The reader of a source (the Node entry adds folders). */
  static async readerFor(source, options = {}) {
    if (typeof source === 'string' || source instanceof URL) return urlReader(source, options.fetch);
    if (source !== null && typeof source === 'object' && !Array.isArray(source)) return bytesReader(source);
    throw new TypeError(`TrainingSession.load: source must be a base URL or an object of file bytes, got ${typeof source}`);
  }

  /** Load through a reader ({ where, read(name), modelPath?(name), check?(name), rereadable? }). */
  static async fromReader(ort, reader, options = {}) {
    const where = reader.where;
    let manifestBytes;
    try {
      manifestBytes = await reader.read('manifest.json');
    } catch (err) {
      if (err instanceof MissingFile) throw new Error(`${where}: missing file manifest.json (${err.message})`);
      throw err;
    }
    const manifest = parseManifest(decodeUtf8(manifestBytes), where);
    let files;
    try {
      files = bundleFiles(manifest);
    } catch (err) {
      throw new Error(`${where}: ${err.message}`);
    }
    const kept = new Map([['manifest.json', manifestBytes]]);
    const missing = [];
    await Promise.all([...files].filter(([name]) => name !== 'manifest.json').map(async ([name, field]) => {
      try {
        // A folder is read again when needed (onnxruntime-node reads programs and
        // constants.bin itself): only state.bin comes into memory now.
        if (reader.rereadable && name !== manifest.state_file) await reader.check(name);
        else kept.set(name, await reader.read(name));
      } catch (err) {
        if (!(err instanceof MissingFile)) throw err;
        missing.push(`${name} (${field}; ${err.message.slice(name.length + 2)})`);
      }
    }));
    if (missing.length) {
      throw new Error(`${where}: missing file${missing.length > 1 ? 's' : ''} ${missing.sort().join(', ')}`);
    }
    const session = new this(ort, manifest, reader, kept, options);
    await session.#openPrograms();
    return session;
  }

  constructor(ort, manifest, reader, kept, options = {}) {
    if (!(kept instanceof Map)) throw new TypeError('use `await TrainingSession.load(ort, source)`');
    this.#ort = ort;
    this.#manifest = manifest;
    this.#reader = reader;
    this.#sessionOptions = { ...(options.sessionOptions ?? {}) };
    this.#stateSpecs = new Map(manifest.state.map((v) => [v.name, new FeedSpec(v)]));
    this.#state = readState(ort, manifest, kept.get(manifest.state_file), reader.where);
    kept.delete(manifest.state_file);
    // A folder on disk is read again when needed; other sources keep their bytes.
    this.#kept = kept;
    const specs = this.#stateSpecs;
    this.#inference = new Program(manifest.inference, 'inference', specs);
    this.#algorithms = manifest.algorithms.map((a, i) => new Program(a, a.label ?? `training_info[${i}].algorithm`, specs));
    this.#initializations = (manifest.initializations ?? []).map(
      (p, i) => p && new Program(p, p.label ?? `training_info[${i}].initialization`, specs));
    this.#inputNames = new Set(this.#inference.inputs.names());
    for (const p of this.#algorithms) for (const n of p.inputs.names()) this.#inputNames.add(n);
    this.#knownFeeds = new Set([...this.#inputNames, ...specs.keys()]);
    this.#position = checkedPosition(manifest.fit_position ?? null, `${reader.where}: manifest.json fit_position`);
    this.#positionSource = this.#position ? 'bundle' : null;
  }

  async #openPrograms() {
    await Promise.all([this.#inference, ...this.#algorithms].map((p) => this.#open(p)));
  }

  async #open(program) {
    if (program.session !== null) return program.session;
    const options = { ...this.#sessionOptions };
    let model;
    if (this.#reader.modelPath && this.#ort.env?.versions?.node) {
      // onnxruntime-node reads the file itself, and constants.bin beside it.
      model = this.#reader.modelPath(program.file);
    } else {
      // onnxruntime-web (in Node too) and react-native: the bytes, and the
      // constants as external data by the name the programs use.
      model = this.#kept.get(program.file) ?? await this.#reader.read(program.file);
      const constants = this.#manifest.constants_file;
      if (constants) {
        if (!this.#kept.has(constants)) this.#kept.set(constants, await this.#reader.read(constants));
        options.externalData = [...(options.externalData ?? []),
          { path: constants, data: this.#kept.get(constants) }];
      }
    }
    try {
      program.session = await this.#ort.InferenceSession.create(model, options);
    } catch (err) {
      throw new Error(`${this.#reader.where}: onnxruntime could not load ${program.label} ` +
        `(${program.file}): ${err?.message ?? err}`, { cause: err });
    }
    return program.session;
  }

  // ------------------------------------------------------------------ steps
  #serial(fn) {
    const result = this.#tail.then(fn);
    this.#tail = result.catch(() => {});
    return result;
  }

  /**
   * Run `program`; stage its bound outputs into `pending` after checking each
   * against its state variable's dtype and shape.  Returns every output.
   */
  async #runProgram(program, feeds, pending, caller, field) {
    const inputs = { ...feeds };
    for (const name of program.entry.state_inputs ?? []) {
      if (inputs[name] === undefined) inputs[name] = pending.get(name) ?? this.#state.get(name);
    }
    const session = await this.#open(program);
    let results;
    try {
      results = await session.run(inputs);
    } catch (err) {
      throw new Error(`${caller}: onnxruntime failed in ${program.label} (${program.file}): ` +
        `${err?.message ?? err}`, { cause: err });
    }
    const staged = [];
    program.entry.bindings?.forEach(({ key, value }, index) => {
      const tensor = results[value];
      const spec = this.#stateSpecs.get(key);
      const dims = Array.from(tensor?.dims ?? []);
      if (tensor?.type !== spec.dtype || !sameShape(dims, spec.shape)) {
        throw new Error(`${caller}: ${bindingPlace(program.label, field, index)}: value '${value}' is ` +
          `${describe(tensor?.type, dims)}, but state variable '${key}' is ${spec.text}`);
      }
      staged.push([key, tensor]);
    });
    for (const [key, tensor] of staged) pending.set(key, tensor);
    return results;
  }

  /**
   * One training step: `{ algorithm: i }` runs training_info[i], none runs
   * every algorithm in order (each sees what the previous ones bound).  The
   * state changes only when every program succeeded.  Returns the outputs no
   * binding consumes (later algorithms win on equal names).
   */
  trainStep(feeds, options = {}) {
    const algorithm = options?.algorithm;
    const n = this.#algorithms.length;
    if (n === 0) return Promise.reject(new Error('trainStep: the bundle has no algorithm: there is nothing to train'));
    let programs;
    if (algorithm === undefined || algorithm === null) programs = this.#algorithms;
    else if (Number.isInteger(algorithm) && algorithm >= 0 && algorithm < n) programs = [this.#algorithms[algorithm]];
    else {
      return Promise.reject(new RangeError(
        `trainStep: algorithm must be undefined or an index in [0, ${n}), got ${String(algorithm)}`));
    }
    let checked;
    try {
      checkFeedNames(feeds, this.#knownFeeds, this.#inputNames, 'trainStep');
      checked = programs.map((p) => p.inputs.check(feeds, 'trainStep', false));
    } catch (err) {
      return Promise.reject(err);
    }
    return this.#serial(async () => {
      const pending = new Map();
      const outputs = {};
      for (let i = 0; i < programs.length; i++) {
        const results = await this.#runProgram(programs[i], checked[i], pending, 'trainStep', 'update_binding');
        for (const name of programs[i].entry.returned) outputs[name] = results[name];
      }
      for (const [key, tensor] of pending) this.#state.set(key, tensor); // every binding at once
      return outputs;
    });
  }

  /** Run every initialization program and apply its bindings (all or nothing). */
  initialize() {
    return this.#serial(async () => {
      const pending = new Map();
      for (const program of this.#initializations) {
        if (program && program.entry.bindings.length) {
          await this.#runProgram(program, {}, pending, 'initialize', 'initialization_binding');
        }
      }
      for (const [key, tensor] of pending) this.#state.set(key, tensor);
      this.#position = null;
      this.#positionSource = null;
    });
  }

  /**
   * Inference on the current state: the main graph's outputs (or those named
   * in `options.outputs`).  A state variable may be fed to override it for
   * this call.  Never changes the state.
   */
  run(feeds, options = {}) {
    const program = this.#inference;
    let checked;
    let names;
    try {
      checkFeedNames(feeds, this.#knownFeeds, this.#inputNames, 'run');
      checked = program.inputs.check(feeds, 'run', true);
      names = options?.outputs ?? program.entry.outputs;
      const bad = names.find((n) => !program.entry.outputs.includes(n));
      if (bad !== undefined) {
        throw new Error(`run: '${bad}' is not an output of the main graph; outputs are [${program.entry.outputs.map((o) => `'${o}'`).join(', ')}]`);
      }
    } catch (err) {
      return Promise.reject(err);
    }
    return this.#serial(async () => {
      const results = await this.#runProgram(program, checked, new Map(), 'run', 'binding');
      return Object.fromEntries(names.map((n) => [n, results[n]]));
    });
  }

  /** Fit over arrays: see fit.js (epochs, batchSize, shuffle, seed, dropLast, cycle, onStep, onEpoch). */
  fit(data, options = {}) {
    return fit(this, data, options);
  }

  // ------------------------------------------------------------------ state
  /** Every state variable -> a copy as an ort.Tensor, in a frozen object. */
  get state() {
    const out = {};
    for (const [name, tensor] of this.#state) out[name] = this.#copy(tensor);
    return Object.freeze(out);
  }

  /** One state variable, as a copy. */
  getState(name) {
    const tensor = this.#state.get(name);
    if (tensor === undefined) throw new Error(`getState: '${name}' is not a state variable; they are [${[...this.#state.keys()].join(', ')}]`);
    return this.#copy(tensor);
  }

  /**
   * Set some state variables from ort.Tensors (or typed arrays of the right
   * dtype and size); dtypes and shapes must match.  All or nothing.
   */
  setState(values) {
    const staged = [];
    for (const [name, value] of Object.entries(values)) {
      const spec = this.#stateSpecs.get(name);
      if (spec === undefined) throw new Error(`setState: '${name}' is not a state variable`);
      let tensor = value;
      if (ArrayBuffer.isView(value)) tensor = new this.#ort.Tensor(spec.dtype, value, spec.shape);
      spec.check(tensor, 'setState', 'state variable');
      staged.push([name, this.#copy(tensor)]);
    }
    return this.#serial(async () => {
      for (const [name, tensor] of staged) this.#state.set(name, tensor);
    });
  }

  #copy(tensor) {
    return new this.#ort.Tensor(tensor.type, tensor.data.slice(), Array.from(tensor.dims));
  }

  /** The names of the state variables, in the manifest's order. */
  get stateNames() {
    return this.#manifest.state.map((v) => v.name);
  }

  /** The manifest (a frozen copy). */
  get manifest() {
    return deepFreeze(structuredCopy(this.#manifest));
  }

  /** The number of algorithms (training_info entries). */
  get numAlgorithms() {
    return this.#algorithms.length;
  }

  /** The ort module this session runs on. */
  get ort() {
    return this.#ort;
  }

  /** The learning rate, where manifest.training.learning_rate names its state variable. */
  get learningRate() {
    const name = this.#learningRateName('learningRate');
    return Number(this.#state.get(name).data[0]);
  }

  set learningRate(value) {
    const name = this.#learningRateName('learningRate');
    if (typeof value !== 'number' || !Number.isFinite(value)) {
      throw new TypeError(`learningRate: expected a finite number, got ${String(value)}`);
    }
    const spec = this.#stateSpecs.get(name);
    if (!['float32', 'float64'].includes(spec.dtype)) {
      throw new TypeError(`learningRate: state variable '${name}' is ${spec.text}; only float32 and float64 rates can be set`);
    }
    const type = elementType(spec.dtype, 'learningRate');
    const data = new type.array(sizeOf(spec.shape)).fill(value);
    this.#state.set(name, new this.#ort.Tensor(spec.dtype, data, spec.shape));
  }

  #learningRateName(caller) {
    const name = this.#manifest.training?.learning_rate?.state;
    if (typeof name !== 'string' || !this.#stateSpecs.has(name)) {
      throw new Error(`${caller}: this bundle records no learning-rate state variable ` +
        '(manifest.json training.learning_rate is null: the rate is a constant of the program, ' +
        'e.g. a hand-written TrainingInfoProto); build the model with onnxtrain\'s builder to get one');
    }
    return name;
  }

  /** Where the fit loop stands, { epoch, batch, step } or null; save writes it. */
  get fitPosition() {
    return this.#position ? { ...this.#position } : null;
  }

  set fitPosition(value) {
    this.#position = checkedPosition(value, 'fitPosition');
    this.#positionSource = this.#position ? 'fit' : null;
  }

  /** Where fitPosition came from: 'bundle' (a fit resumes from it), 'fit', or null. */
  get positionSource() {
    return this.#positionSource;
  }

  /** A state.bin of the current state, laid out as the loaded manifest says. */
  stateBytes() {
    const out = new Uint8Array(this.#manifest.state_bytes);
    for (const v of this.#manifest.state) out.set(bytesOf(this.#state.get(v.name).data), v.offset);
    return out;
  }

  /** The manifest of a bundle of the current state (the fit position updated). */
  manifestText() {
    const m = structuredCopy(this.#manifest);
    m.fit_position = this.fitPosition;
    return `${JSON.stringify(m, null, 2)}\n`;
  }

  /**
   * Every file of a complete bundle of the current state, { name: Uint8Array }
   * (for a download, or to store with the platform's own file API).
   * `{ paths: true }` (Node): a file of a folder source that was not kept in
   * memory comes as { path } to copy, rather than as bytes.
   */
  bundleFiles(options = {}) {
    return this.#serial(async () => {
      const out = {};
      for (const name of bundleFiles(this.#manifest).keys()) {
        if (name === 'manifest.json') out[name] = encodeUtf8(this.manifestText());
        else if (name === this.#manifest.state_file) out[name] = this.stateBytes();
        else if (this.#kept.has(name)) out[name] = this.#kept.get(name);
        else if (options.paths && this.#reader.modelPath) out[name] = { path: this.#reader.modelPath(name) };
        else out[name] = await this.#reader.read(name);
      }
      return out;
    });
  }

  /** Node only (the Node entry implements it): `save(folder, { overwrite })`. */
  // eslint-disable-next-line no-unused-vars
  async save(folder, options = {}) {
    throw new Error('save(folder) writes files and needs Node (the "node" entry of onnxtrain); ' +
      'elsewhere use `await sess.bundleFiles()` (every file as bytes) or `sess.stateBytes()`');
  }

  /** Release every onnxruntime session. */
  async release() {
    await this.#serial(async () => {
      for (const p of [this.#inference, ...this.#algorithms, ...this.#initializations]) {
        if (p?.session) {
          await p.session.release();
          p.session = null;
        }
      }
    });
  }
}

function checkOrt(ort) {
  if (ort === null || typeof ort !== 'object' && typeof ort !== 'function'
    || typeof ort.InferenceSession?.create !== 'function' || typeof ort.Tensor !== 'function') {
    throw new TypeError('TrainingSession.load: the first argument must be the onnxruntime module ' +
      "(import * as ort from 'onnxruntime-node', 'onnxruntime-web' or 'onnxruntime-react-native')");
  }
}

/** state.bin -> name -> ort.Tensor (each a copy, so the file's buffer can go). */
function readState(ort, manifest, bytes, where) {
  if (bytes.byteLength !== manifest.state_bytes) {
    throw new Error(`${where}: ${manifest.state_file} holds ${bytes.byteLength} bytes, ` +
      `but manifest.json says state_bytes ${manifest.state_bytes}`);
  }
  if (new Uint8Array(new Uint16Array([1]).buffer)[0] !== 1) {
    throw new Error(`${where}: state.bin is little-endian, and this platform is not`);
  }
  const state = new Map();
  for (const v of manifest.state) {
    const type = elementType(v.dtype, `${where}: state variable '${v.name}'`);
    const copy = bytes.slice(v.offset, v.offset + v.length);
    const data = new type.array(copy.buffer, 0, v.length / type.bytes);
    state.set(v.name, new ort.Tensor(type.ort, data, v.shape));
  }
  return state;
}

function checkedPosition(value, where) {
  if (value === null || value === undefined) return null;
  const out = {};
  for (const key of ['epoch', 'batch', 'step']) {
    const v = value[key] ?? 0;
    if (!Number.isInteger(v) || v < 0) {
      throw new Error(`${where}: ${key} must be a whole number >= 0, got ${JSON.stringify(value[key])}`);
    }
    out[key] = v;
  }
  return out;
}

function structuredCopy(value) {
  return JSON.parse(JSON.stringify(value));
}

function deepFreeze(value) {
  if (value !== null && typeof value === 'object') {
    for (const v of Object.values(value)) deepFreeze(v);
    Object.freeze(value);
  }
  return value;
}
