// Where a bundle's files come from: an object of bytes already read, or a
// base URL fetched file by file.  (The Node entry adds folders on disk.)
// A reader is { where, read(name) -> Promise<Uint8Array> }; read throws a
// MissingFile for a file that is not there, so `load` can name every missing
// file in one message.

export class MissingFile extends Error {
  constructor(name, why) {
    super(`${name}: ${why}`);
    this.file = name;
  }
}

/** The bytes of a file value: Uint8Array, ArrayBuffer, typed array, string or object. */
export function asBytes(value, name) {
  if (value instanceof Uint8Array) return value;
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  if (typeof value === 'string') return encodeUtf8(value);
  if (name === 'manifest.json' && value !== null && typeof value === 'object') {
    return encodeUtf8(JSON.stringify(value));
  }
  throw new TypeError(`${name}: expected the file's bytes (Uint8Array or ArrayBuffer), got ${typeof value}`);
}

/** A reader over `{ 'manifest.json': ..., 'state.bin': Uint8Array, ... }`. */
export function bytesReader(files) {
  return {
    where: 'bundle (files given as bytes)',
    async read(name) {
      if (!Object.hasOwn(files, name) || files[name] === undefined || files[name] === null) {
        throw new MissingFile(name, 'not among the files given');
      }
      return asBytes(files[name], name);
    },
  };
}

/**
 * A reader over a base URL (absolute, or relative to the page's address);
 * the trailing slash is optional.  `fetchFn` defaults to the global fetch.
 */
export function urlReader(base, fetchFn = globalThis.fetch) {
  if (typeof fetchFn !== 'function') {
    throw new Error(`bundle ${String(base)}: no fetch() here to read a URL; pass the files as bytes instead`);
  }
  const page = globalThis.document?.baseURI ?? globalThis.location?.href;
  let url;
  try {
    url = page === undefined ? new URL(String(base)) : new URL(String(base), page);
  } catch {
    throw new Error(`bundle ${String(base)}: not a URL (give an absolute URL, or one relative to the page)`);
  }
  if (!url.pathname.endsWith('/')) url.pathname += '/';
  return {
    where: `bundle ${url.href}`,
    async read(name) {
      const address = new URL(encodeURIComponent(name), url);
      let response;
      try {
        response = await fetchFn(address.href);
      } catch (err) {
        throw new Error(`bundle ${url.href}: fetching ${name} failed: ${err.message}`, { cause: err });
      }
      if (response.status === 404 || response.status === 410) {
        throw new MissingFile(name, `${address.href} answered ${response.status}`);
      }
      if (!response.ok) {
        throw new Error(`bundle ${url.href}: fetching ${name} answered ${response.status} ${response.statusText}`);
      }
      return new Uint8Array(await response.arrayBuffer());
    },
  };
}

/** UTF-8 text -> bytes (TextEncoder where the platform has one). */
export function encodeUtf8(text) {
  if (typeof TextEncoder !== 'undefined') return new TextEncoder().encode(text);
  const out = [];
  for (const ch of text) {
    let c = ch.codePointAt(0);
    if (c < 0x80) out.push(c);
    else if (c < 0x800) out.push(0xc0 | (c >> 6), 0x80 | (c & 63));
    else if (c < 0x10000) out.push(0xe0 | (c >> 12), 0x80 | ((c >> 6) & 63), 0x80 | (c & 63));
    else out.push(0xf0 | (c >> 18), 0x80 | ((c >> 12) & 63), 0x80 | ((c >> 6) & 63), 0x80 | (c & 63));
  }
  return Uint8Array.from(out);
}

/** UTF-8 bytes -> text (TextDecoder where the platform has one). */
export function decodeUtf8(bytes) {
  if (typeof TextDecoder !== 'undefined') return new TextDecoder().decode(bytes);
  let text = '';
  for (let i = 0; i < bytes.length;) {
    const b = bytes[i];
    const n = b < 0x80 ? 1 : b < 0xe0 ? 2 : b < 0xf0 ? 3 : 4;
    let c = n === 1 ? b : b & (0xff >> (n + 1));
    for (let k = 1; k < n; k++) c = (c << 6) | (bytes[i + k] & 63);
    text += String.fromCodePoint(c);
    i += n;
  }
  return text;
}
