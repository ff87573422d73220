// Element types: a bundle's dtype names (numpy's) -> onnxruntime's tensor type
// and the typed array that holds the values.  onnxruntime's JavaScript API has
// no bfloat16 tensor, so a bundle with a bfloat16 state variable or feed is
// refused when it loads, not on the first step.

const TYPES = {
  float32: { ort: 'float32', array: Float32Array, bytes: 4 },
  float64: { ort: 'float64', array: Float64Array, bytes: 8 },
  // float16 values travel as their bit patterns (onnxruntime accepts a
  // Uint16Array; it may return a Float16Array where the platform has one).
  float16: { ort: 'float16', array: Uint16Array, bytes: 2 },
  int8: { ort: 'int8', array: Int8Array, bytes: 1 },
  uint8: { ort: 'uint8', array: Uint8Array, bytes: 1 },
  int16: { ort: 'int16', array: Int16Array, bytes: 2 },
  uint16: { ort: 'uint16', array: Uint16Array, bytes: 2 },
  int32: { ort: 'int32', array: Int32Array, bytes: 4 },
  uint32: { ort: 'uint32', array: Uint32Array, bytes: 4 },
  int64: { ort: 'int64', array: BigInt64Array, bytes: 8 },
  uint64: { ort: 'uint64', array: BigUint64Array, bytes: 8 },
  bool: { ort: 'bool', array: Uint8Array, bytes: 1 },
};

/** The element type of a bundle dtype name, or an Error naming `where`. */
export function elementType(dtype, where) {
  const type = Object.hasOwn(TYPES, dtype) ? TYPES[dtype] : undefined;
  if (type === undefined) {
    const hint = dtype === 'bfloat16'
      ? "onnxruntime's JavaScript API has no bfloat16 tensor"
      : `known dtypes are ${Object.keys(TYPES).join(', ')}`;
    throw new Error(`${where}: dtype ${JSON.stringify(dtype)} is not supported (${hint})`);
  }
  return type;
}

/** The number of elements of a static shape. */
export function sizeOf(shape) {
  let n = 1;
  for (const d of shape) n *= d;
  return n;
}

/** A tensor type and shape as the bundle's messages write it: float32['N', 64]. */
export function describe(dtype, shape) {
  if (shape === null || shape === undefined) return `${dtype} (any shape)`;
  const dims = shape.map((d) => (typeof d === 'string' ? `'${d}'` : d === null ? "'?'" : String(d)));
  return `${dtype}[${dims.join(', ')}]`;
}

/** The bytes of a typed array (a view, not a copy). */
export function bytesOf(data) {
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
}

/** True when `data` holds `dtype`'s values as onnxruntime accepts them. */
export function holds(dtype, data) {
  const type = TYPES[dtype];
  if (data instanceof type.array) return true;
  return dtype === 'float16' && typeof Float16Array !== 'undefined' && data instanceof Float16Array;
}

/**
 * `values` (a typed array or an array of numbers, bigints or booleans) as
 * the typed array of `dtype`; the same object when it already is one.
 */
export function toTypedArray(dtype, values, where) {
  const type = elementType(dtype, where);
  if (holds(dtype, values)) return values;
  if (values === null || typeof values !== 'object' || typeof values.length !== 'number') {
    throw new TypeError(`${where}: expected an array or typed array of ${dtype} values, got ${kindOf(values)}`);
  }
  const out = new type.array(values.length);
  const wide = type.array === BigInt64Array || type.array === BigUint64Array;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (wide) {
      if (typeof v === 'bigint') out[i] = v;
      else if (Number.isInteger(v)) out[i] = BigInt(v);
      else throw new TypeError(`${where}: element ${i} is ${String(v)}, not an integer (${dtype})`);
    } else {
      out[i] = typeof v === 'bigint' ? Number(v) : Number(v);
    }
  }
  return out;
}

/** A short description of a value's kind, for messages. */
export function kindOf(value) {
  if (value === null) return 'null';
  if (typeof value !== 'object') return typeof value;
  return value.constructor?.name ?? 'object';
}
