// manifest.json: read, checked once, and the layout of state.bin
// (docs/bundle.md is the format; this file is its JavaScript reader).

import { describe, elementType, sizeOf } from './dtypes.js';

export const FORMAT = 'onnxtrain-bundle';
/** The bundle versions this package reads. */
export const VERSIONS = Object.freeze([1]);

/**
 * The manifest as an object, checked: format, version, the state layout,
 * and every program's feeds, outputs and bindings.  `where` names the bundle
 * in messages.
 */
export function parseManifest(input, where) {
  let m = input;
  if (typeof input === 'string') {
    try {
      m = JSON.parse(input);
    } catch (err) {
      throw new Error(`${where}: manifest.json is not valid JSON (${err.message})`);
    }
  }
  if (m === null || typeof m !== 'object' || Array.isArray(m)) {
    throw new Error(`${where}: manifest.json must hold a JSON object`);
  }
  if (m.format !== FORMAT) {
    throw new Error(`${where}: manifest.json has format ${JSON.stringify(m.format)}, expected "${FORMAT}"`);
  }
  if (!VERSIONS.includes(m.version)) {
    throw new Error(
      `${where}: bundle version ${JSON.stringify(m.version)} is not one this onnxtrain reads ` +
      `(it reads version ${VERSIONS.join(', ')}); load it with a newer onnxtrain`,
    );
  }
  checkState(m, where);
  const known = new Set(m.state.map((v) => v.name));
  checkProgram(m.inference, 'inference', where, known, false);
  need(Array.isArray(m.algorithms), where, 'algorithms must be a list');
  m.algorithms.forEach((a, i) => checkProgram(a, `algorithms[${i}]`, where, known, true));
  need(Array.isArray(m.initializations ?? []), where, 'initializations must be a list');
  (m.initializations ?? []).forEach((p, i) => {
    if (p !== null) checkBindings(p, `initializations[${i}]`, where, known);
  });
  return m;
}

function need(ok, where, text) {
  if (!ok) throw new Error(`${where}: manifest.json: ${text}`);
}

function checkState(m, where) {
  need(Array.isArray(m.state), where, 'state must be a list');
  need(typeof m.state_file === 'string', where, 'state_file must name a file');
  need(Number.isInteger(m.state_bytes) && m.state_bytes >= 0, where, 'state_bytes must be a byte count');
  const seen = new Set();
  m.state.forEach((v, i) => {
    const at = `state[${i}]`;
    need(typeof v?.name === 'string', where, `${at}.name must be a string`);
    need(!seen.has(v.name), where, `${at}: state variable '${v.name}' is listed twice`);
    seen.add(v.name);
    const type = elementType(v.dtype, `${where}: manifest.json ${at} ('${v.name}')`);
    need(Array.isArray(v.shape) && v.shape.every((d) => Number.isInteger(d) && d >= 0), where,
      `${at} ('${v.name}'): shape must be a list of sizes, got ${JSON.stringify(v.shape)}`);
    const length = sizeOf(v.shape) * type.bytes;
    need(v.length === length, where,
      `${at} ('${v.name}'): length ${v.length} bytes, but ${describe(v.dtype, v.shape)} takes ${length}`);
    need(Number.isInteger(v.offset) && v.offset >= 0 && v.offset % type.bytes === 0
      && v.offset + v.length <= m.state_bytes, where,
    `${at} ('${v.name}'): offset ${v.offset} + length ${v.length} does not fit in ` +
      `state_bytes ${m.state_bytes} (or is not aligned to its elements)`);
  });
}

function checkProgram(p, at, where, known, bound) {
  need(p !== null && typeof p === 'object', where, `${at} must be an object`);
  need(typeof p.file === 'string', where, `${at}.file must name a file`);
  for (const key of ['feeds', 'optional_feeds']) {
    need(Array.isArray(p[key] ?? []), where, `${at}.${key} must be a list`);
    (p[key] ?? []).forEach((f, i) => {
      need(typeof f?.name === 'string', where, `${at}.${key}[${i}].name must be a string`);
      elementType(f.dtype, `${where}: manifest.json ${at}.${key}[${i}] ('${f.name}')`);
    });
  }
  need(Array.isArray(p.state_inputs), where, `${at}.state_inputs must be a list`);
  for (const name of p.state_inputs) {
    need(known.has(name), where, `${at}.state_inputs: '${name}' is not a state variable`);
  }
  need(Array.isArray(p.outputs), where, `${at}.outputs must be a list`);
  if (bound) {
    need(Array.isArray(p.returned), where, `${at}.returned must be a list`);
    checkBindings(p, at, where, known);
  }
}

function checkBindings(p, at, where, known) {
  need(typeof p.file === 'string', where, `${at}.file must name a file`);
  need(Array.isArray(p.bindings), where, `${at}.bindings must be a list`);
  const outputs = new Set(p.outputs ?? []);
  p.bindings.forEach((b, i) => {
    need(known.has(b?.key), where, `${at}.bindings[${i}]: key '${b?.key}' is not a state variable`);
    need(outputs.has(b.value), where, `${at}.bindings[${i}]: value '${b.value}' is not an output of ${p.file}`);
  });
}

/**
 * Every file a complete bundle holds, with the manifest field that names it
 * (for the missing-file message).
 */
export function bundleFiles(m) {
  const files = new Map([['manifest.json', 'manifest.json']]);
  const add = (name, field) => {
    if (name === null || name === undefined) return;
    // Every file sits at the bundle's root: a name never leaves the folder.
    if (typeof name !== 'string' || !/^[^/\\]+$/.test(name) || name === '.' || name === '..') {
      throw new Error(`manifest.json: ${field} must be a file name in the bundle's folder, got ${JSON.stringify(name)}`);
    }
    if (!files.has(name)) files.set(name, field);
  };
  add(m.state_file, 'state_file');
  add(m.constants_file, 'constants_file');
  add(m.inference.file, 'inference.file');
  m.algorithms.forEach((a, i) => add(a.file, `algorithms[${i}].file`));
  (m.initializations ?? []).forEach((p, i) => p && add(p.file, `initializations[${i}].file`));
  add(m.inference_model, 'inference_model');
  add(m.training_model, 'training_model');
  return files;
}
