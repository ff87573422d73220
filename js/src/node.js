// onnxtrain for Node: everything index.js has, plus bundle folders on disk
// (load(ort, '/path/to/bundle'), save(folder)).  The node: modules are
// imported on first use only.

import { TrainingSession as Core } from './session.js';
import { MissingFile } from './sources.js';

export { VERSION } from './session.js';
export { VERSIONS, FORMAT } from './manifest.js';
export { permutation } from './fit.js';

async function node() {
  const [fs, path, url] = await Promise.all([import('node:fs/promises'), import('node:path'), import('node:url')]);
  return { fs, path, url };
}

/** A reader over a folder on disk: programs load by path, beside constants.bin. */
async function folderReader(folder) {
  const { fs, path } = await node();
  const root = path.resolve(folder);
  let info;
  try {
    info = await fs.stat(root);
  } catch (err) {
    if (err.code === 'ENOENT') throw new Error(`bundle ${root}: no such folder`);
    throw err;
  }
  if (!info.isDirectory()) throw new Error(`bundle ${root}: not a folder (a bundle is a folder holding manifest.json)`);
  const missing = (name, err) => (err.code === 'ENOENT' ? new MissingFile(name, 'no such file') : err);
  return {
    where: `bundle ${root}`,
    rereadable: true,
    modelPath: (name) => path.join(root, name),
    async check(name) {
      let stat;
      try {
        stat = await fs.stat(path.join(root, name));
      } catch (err) {
        throw missing(name, err);
      }
      if (!stat.isFile()) throw new MissingFile(name, 'not a regular file');
    },
    async read(name) {
      try {
        return new Uint8Array(await fs.readFile(path.join(root, name)));
      } catch (err) {
        throw missing(name, err);
      }
    },
  };
}

export class TrainingSession extends Core {
  /** A folder path or file: URL on disk; else as in the browser (http(s) URL, object of bytes). */
  static async readerFor(source, options = {}) {
    if (source instanceof URL && source.protocol === 'file:') {
      const { url } = await node();
      return folderReader(url.fileURLToPath(source));
    }
    if (typeof source === 'string' && !/^[a-z][a-z0-9+.-]*:\/\//i.test(source)) return folderReader(source);
    if (typeof source === 'string' && source.startsWith('file://')) {
      const { url } = await node();
      return folderReader(url.fileURLToPath(source));
    }
    return super.readerFor(source, options);
  }

  /**
   * Write a complete bundle of the current state to `folder`: every file, a
   * new state.bin and a manifest with the fit position.  Atomic: written to
   * a temporary folder beside it, then renamed into place.  Refuses an
   * existing non-empty folder (or a file) unless `{ overwrite: true }`.
   */
  async save(folder, options = {}) {
    const { fs, path } = await node();
    const target = path.resolve(String(folder));
    const existing = await fs.lstat(target).catch((err) => (err.code === 'ENOENT' ? null : Promise.reject(err)));
    if (existing !== null) {
      if (!existing.isDirectory()) {
        throw new Error(`save: ${target} exists and is not a folder; nothing was written`);
      }
      const entries = await fs.readdir(target);
      if (entries.length && !options.overwrite) {
        throw new Error(`save: ${target} is a folder that is not empty; pass { overwrite: true } to replace it (nothing was written)`);
      }
    }
    const files = await this.bundleFiles({ paths: true });
    const parent = path.dirname(target);
    await fs.mkdir(parent, { recursive: true });
    const temp = await fs.mkdtemp(path.join(parent, `.${path.basename(target)}.tmp-`));
    try {
      for (const [name, content] of Object.entries(files)) {
        const to = path.join(temp, name);
        if (content instanceof Uint8Array) await fs.writeFile(to, content);
        else await fs.copyFile(content.path, to);
      }
      if (existing === null) {
        await fs.rename(temp, target);
      } else {
        // Swap: the old folder moves aside, the new one takes its name, the old one goes.
        const old = `${temp}.old`;
        await fs.rename(target, old);
        try {
          await fs.rename(temp, target);
        } catch (err) {
          await fs.rename(old, target);
          throw err;
        }
        await fs.rm(old, { recursive: true, force: true });
      }
    } catch (err) {
      await fs.rm(temp, { recursive: true, force: true });
      throw err;
    }
    return target;
  }
}
