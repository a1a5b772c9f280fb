//! POSIX `sh` helpers shared by the backends that drive a box through commands (Docker,
//! Kubernetes): the tree listing (script and parser), the workspace swap of a `Replace`
//! import, a symlink-safe remove, and the marker-based process-tree kill.

use crate::backend::{EntryType, TreeEntry};
use crate::error::{Error, Result};
use crate::path::RelPath;

/// Parse either format. GNU records are `type mode size mtime inode name\0target\0`; busybox
/// records start with `token` and are `S<hexmode> size secs date time zone inode ./name\n`
/// or `L./name\0target\n`.
pub fn parse_listing(backend: &'static str, out: &[u8], token: &str) -> Result<Vec<TreeEntry>> {
    let text = String::from_utf8_lossy(out);
    if text.starts_with(token) {
        parse_busybox(backend, &text, token)
    } else {
        parse_gnu(backend, &text)
    }
}

fn bad(backend: &'static str, what: &str) -> Error {
    Error::backend(backend, "list", format!("unexpected listing: {what}"))
}

fn parse_gnu(backend: &'static str, text: &str) -> Result<Vec<TreeEntry>> {
    let mut out = Vec::new();
    let mut fields = text.split('\0');
    while let Some(record) = fields.next() {
        if record.is_empty() {
            break;
        }
        let target = fields
            .next()
            .ok_or_else(|| bad(backend, "missing link field"))?;
        let mut parts = record.splitn(6, ' ');
        let mut next = || parts.next().ok_or_else(|| bad(backend, record));
        let (kind, mode, size, mtime, inode, name) =
            (next()?, next()?, next()?, next()?, next()?, next()?);
        let kind = match kind {
            "f" => EntryType::File,
            "d" => EntryType::Dir,
            "l" => EntryType::Symlink,
            _ => EntryType::Other,
        };
        let mode = u32::from_str_radix(mode, 8).map_err(|_| bad(backend, record))? & 0o7777;
        let size: u64 = size.parse().map_err(|_| bad(backend, record))?;
        let mtime_ns = parse_decimal_ns(mtime).ok_or_else(|| bad(backend, record))?;
        let Ok(path) = RelPath::new(name) else {
            continue;
        };
        let mut e = TreeEntry::new(
            path,
            kind,
            if kind == EntryType::File { size } else { 0 },
            mtime_ns,
            mode,
        );
        e.inode = inode.parse().ok();
        if kind == EntryType::Symlink {
            e.link_target = Some(target.to_owned());
        }
        out.push(e);
    }
    Ok(out)
}

/// `secs.fraction` → nanoseconds.
fn parse_decimal_ns(s: &str) -> Option<i64> {
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: i64 = secs.parse().ok()?;
    let mut digits: String = frac.chars().take(9).collect();
    while digits.len() < 9 {
        digits.push('0');
    }
    let ns: i64 = digits.parse().ok()?;
    Some(secs * 1_000_000_000 + if secs < 0 { -ns } else { ns })
}

fn parse_busybox(backend: &'static str, text: &str, token: &str) -> Result<Vec<TreeEntry>> {
    let mut entries: Vec<TreeEntry> = Vec::new();
    let mut links = std::collections::HashMap::new();
    for record in text.split(token).skip(1) {
        if let Some(rest) = record.strip_prefix('S') {
            let rest = rest.strip_suffix('\n').unwrap_or(rest);
            let mut parts = rest.splitn(8, ' ');
            let mut next = || parts.next().ok_or_else(|| bad(backend, rest));
            let (raw_mode, size, secs, _date, time, _zone, inode, name) = (
                next()?,
                next()?,
                next()?,
                next()?,
                next()?,
                next()?,
                next()?,
                next()?,
            );
            let raw = u32::from_str_radix(raw_mode, 16).map_err(|_| bad(backend, rest))?;
            let kind = match raw & 0o170000 {
                0o100000 => EntryType::File,
                0o040000 => EntryType::Dir,
                0o120000 => EntryType::Symlink,
                _ => EntryType::Other,
            };
            let secs: i64 = secs.parse().map_err(|_| bad(backend, rest))?;
            let frac = time.split_once('.').map_or("", |(_, f)| f);
            let ns = parse_decimal_ns(&format!("0.{frac}")).unwrap_or(0);
            let size: u64 = size.parse().map_err(|_| bad(backend, rest))?;
            let Ok(path) = RelPath::new(name.trim_start_matches("./")) else {
                continue;
            };
            let mut e = TreeEntry::new(
                path,
                kind,
                if kind == EntryType::File { size } else { 0 },
                secs * 1_000_000_000 + ns,
                raw & 0o7777,
            );
            e.inode = inode.parse().ok();
            entries.push(e);
        } else if let Some(rest) = record.strip_prefix('L') {
            let (name, target) = rest.split_once('\0').ok_or_else(|| bad(backend, rest))?;
            let target = target.strip_suffix('\n').unwrap_or(target);
            links.insert(name.trim_start_matches("./").to_owned(), target.to_owned());
        } else if !record.is_empty() {
            return Err(bad(backend, record));
        }
    }
    for e in &mut entries {
        if e.kind == EntryType::Symlink {
            e.link_target = links.remove(e.path.as_str());
        }
    }
    Ok(entries)
}

/// Arguments: root, staging dir name (empty: only empty the workspace), keep list (newline
/// separated, with a leading and trailing newline).
pub const SWAP_SCRIPT: &str = r#"
set -e
R=$1; S=$2; K=$3
role() {
  case "$K" in *"
$1
"*) echo keep; return ;; esac
  case "$K" in *"
$1/"*) echo anc; return ;; esac
  echo none
}
clean() {
  local d e n rel
  d=$R${1:+/$1}
  for e in "$d"/* "$d"/.[!.]* "$d"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    n=${e##*/}; rel=${1:+$1/}$n
    if [ -z "$1" ] && [ -n "$S" ] && [ "$n" = "$S" ]; then continue; fi
    case $(role "$rel") in
      keep) ;;
      anc) if [ -d "$e" ] && [ ! -L "$e" ]; then clean "$rel"; fi ;;
      *) rm -rf -- "$e" ;;
    esac
  done
}
fill() {
  local d e n rel
  d=$R/$S${1:+/$1}
  for e in "$d"/* "$d"/.[!.]* "$d"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    n=${e##*/}; rel=${1:+$1/}$n
    case $(role "$rel") in
      keep) ;;
      anc) if [ -d "$e" ] && [ ! -L "$e" ]; then
             if [ ! -d "$R/$rel" ] || [ -L "$R/$rel" ]; then rm -rf -- "$R/$rel"; mkdir -p -- "$R/$rel"; fi
             fill "$rel"
           fi ;;
      *) mv -- "$e" "$R/$rel" ;;
    esac
  done
}
clean ""
if [ -n "$S" ]; then
  fill ""
  rm -rf -- "$R/$S"
fi
"#;

/// Remove workspace paths, never passing through a symlinked ancestor. Arguments: root,
/// then the relative paths.
pub const REMOVE_SCRIPT: &str = r#"
R=$1; shift
for p in "$@"; do
  cur=$R; rest=$p; ok=1
  while :; do
    case $rest in */*) ;; *) break ;; esac
    c=${rest%%/*}; rest=${rest#*/}; cur=$cur/$c
    if [ -L "$cur" ] || [ ! -d "$cur" ]; then ok=; break; fi
  done
  [ -n "$ok" ] && rm -rf -- "$R/$p"
done
exit 0
"#;

/// List the tree under the root: GNU find's `-printf` where it exists, else busybox `stat`.
/// Arguments: root, a random record token.
pub const LIST_SCRIPT: &str = r#"
cd "$1" || exit 3
T=$2
if find . -maxdepth 0 -printf '' >/dev/null 2>&1; then
  exec find . -mindepth 1 -printf '%y %m %s %T@ %i %P\0%l\0'
fi
find . -mindepth 1 -exec stat -c "${T}S%f %s %Y %y %i %n" {} + || exit 4
find . -mindepth 1 -type l -exec sh -c 'for f; do printf "%sL%s\0" "$0" "$f"; readlink "$f"; done' "$T" {} +
"#;

/// Shell functions: `reap <marker>` kills every process carrying the marker in its
/// environment, and their descendants, and returns 0 once none is left. Builtins only (no
/// `$(…)`, no pipes, no external program): see the module documentation. Shared by the kill
/// exec and the exec agent (which reaps after every command).
///
/// `carries` reads an `environ` file with `read`, which drops the NUL separators (dash, bash
/// and busybox alike), so the marker is looked for as a substring of the joined variables:
/// the marker value is a random 32-digit id, so no other variable matches by accident.
#[macro_export]
macro_rules! posix_reap_fn {
    () => {
        r#"
carries() {
  while IFS= read -r _rl || [ -n "$_rl" ]; do
    case $_rl in *"$2"*) return 0 ;; esac
  done 2>/dev/null < "$1"
  return 1
}
reap() {
  _rm="SANDBOX_EXEC_ID=$1"
  _rr=0
  while [ $_rr -lt 50 ]; do
    set --
    for _rf in /proc/[0-9]*/environ; do
      _rp=${_rf#/proc/}; _rp=${_rp%/environ}
      [ "$_rp" = "$$" ] && continue
      if carries "$_rf" "$_rm"; then set -- "$@" "$_rp"; fi
    done
    [ $# -eq 0 ] && return 0
    kill -STOP "$@" 2>/dev/null
    _rg=1
    while [ -n "$_rg" ]; do
      _rg=
      for _rs in /proc/[0-9]*/status; do
        _rq=${_rs#/proc/}; _rq=${_rq%/status}
        case " $* " in *" $_rq "*) continue ;; esac
        _rpp=
        while read -r _rk _rv; do
          if [ "$_rk" = "PPid:" ]; then _rpp=$_rv; break; fi
        done 2>/dev/null < "$_rs"
        case " $* " in *" $_rpp "*) kill -STOP "$_rq" 2>/dev/null; set -- "$@" "$_rq"; _rg=1 ;; esac
      done
    done
    kill -KILL "$@" 2>/dev/null
    _rr=$((_rr + 1))
  done
  return 1
}
"#
    };
}

/// Kill every process carrying the marker `$1` (`SANDBOX_EXEC_ID=$1`), and their descendants.
pub const KILL_SCRIPT: &str = concat!(posix_reap_fn!(), "reap \"$1\"\n");

/// Name of the marker variable [`KILL_SCRIPT`] looks for.
pub const MARKER_VAR: &str = "SANDBOX_EXEC_ID";

/// An absolute in-box path without `..`, NUL or newline.
pub fn check_root(root: &str) -> Result<()> {
    if !root.starts_with('/')
        || root == "/"
        || root.split('/').any(|c| c == "..")
        || root.contains(['\0', '\n'])
    {
        return Err(Error::invalid(
            "workspace root",
            format!("`{root}` must be an absolute path below `/` without `..`"),
        ));
    }
    Ok(())
}

/// A POSIX-ish environment variable name.
pub fn check_env_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && !name.as_bytes()[0].is_ascii_digit()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            "environment variable",
            format!("`{name}` is not a valid name"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gnu_records() {
        let out = b"d 755 4096 1796007099.9732087980 12 dir with space\0\0f 4644 3 1796007099.5 13 dir with space/f\nnl\0\0l 777 1 1.0 14 ln\0d/f\0";
        let e = parse_listing("t", out, "\u{1}tok\u{1}").unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!(e[0].path.as_str(), "dir with space");
        assert_eq!(
            (e[0].kind, e[0].size, e[0].mode),
            (EntryType::Dir, 0, 0o755)
        );
        assert_eq!(e[0].mtime_ns, 1_796_007_099_973_208_798);
        assert_eq!(e[1].path.as_str(), "dir with space/f\nnl");
        assert_eq!(
            (e[1].kind, e[1].size, e[1].mode),
            (EntryType::File, 3, 0o4644)
        );
        assert_eq!(e[1].mtime_ns, 1_796_007_099_500_000_000);
        assert_eq!(e[2].link_target.as_deref(), Some("d/f"));
        assert_eq!(e[2].inode, Some(14));
    }

    #[test]
    fn busybox_records() {
        let t = "\u{1}tok\u{1}";
        let out = format!(
            "{t}S41ed 4096 1796007099 2026-11-30 02:51:39.973208798 +0000 836071 ./d\n{t}S81a4 3 1796007099 2026-11-30 02:51:39.000000001 +0000 836073 ./d/f\nx\n{t}Sa1ff 3 1796007099 2026-11-30 02:51:39.979200296 +0000 836074 ./l\n{t}L./l\0d/f\n"
        );
        let e = parse_listing("t", out.as_bytes(), t).unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!((e[0].kind, e[0].mode), (EntryType::Dir, 0o755));
        assert_eq!(e[0].mtime_ns, 1_796_007_099_973_208_798);
        assert_eq!(e[1].path.as_str(), "d/f\nx");
        assert_eq!(
            (e[1].kind, e[1].size, e[1].mtime_ns),
            (EntryType::File, 3, 1_796_007_099_000_000_001)
        );
        assert_eq!(
            (e[2].kind, e[2].link_target.as_deref()),
            (EntryType::Symlink, Some("d/f"))
        );
    }
}
