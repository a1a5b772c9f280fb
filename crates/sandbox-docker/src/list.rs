//! Parsing the output of the list helper (GNU `find -printf` or busybox `stat`).

use sandbox_core::{EntryType, Error, RelPath, Result, TreeEntry};

use crate::BACKEND;

/// Parse either format. GNU records are `type mode size mtime inode name\0target\0`; busybox
/// records start with `token` and are `S<hexmode> size secs date time zone inode ./name\n`
/// or `L./name\0target\n`.
pub(crate) fn parse(out: &[u8], token: &str) -> Result<Vec<TreeEntry>> {
    let text = String::from_utf8_lossy(out);
    if text.starts_with(token) {
        parse_busybox(&text, token)
    } else {
        parse_gnu(&text)
    }
}

fn bad(what: &str) -> Error {
    Error::backend(BACKEND, "list", format!("unexpected listing: {what}"))
}

fn parse_gnu(text: &str) -> Result<Vec<TreeEntry>> {
    let mut out = Vec::new();
    let mut fields = text.split('\0');
    while let Some(record) = fields.next() {
        if record.is_empty() {
            break;
        }
        let target = fields.next().ok_or_else(|| bad("missing link field"))?;
        let mut parts = record.splitn(6, ' ');
        let mut next = || parts.next().ok_or_else(|| bad(record));
        let (kind, mode, size, mtime, inode, name) =
            (next()?, next()?, next()?, next()?, next()?, next()?);
        let kind = match kind {
            "f" => EntryType::File,
            "d" => EntryType::Dir,
            "l" => EntryType::Symlink,
            _ => EntryType::Other,
        };
        let mode = u32::from_str_radix(mode, 8).map_err(|_| bad(record))? & 0o7777;
        let size: u64 = size.parse().map_err(|_| bad(record))?;
        let mtime_ns = parse_decimal_ns(mtime).ok_or_else(|| bad(record))?;
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

fn parse_busybox(text: &str, token: &str) -> Result<Vec<TreeEntry>> {
    let mut entries: Vec<TreeEntry> = Vec::new();
    let mut links = std::collections::HashMap::new();
    for record in text.split(token).skip(1) {
        if let Some(rest) = record.strip_prefix('S') {
            let rest = rest.strip_suffix('\n').unwrap_or(rest);
            let mut parts = rest.splitn(8, ' ');
            let mut next = || parts.next().ok_or_else(|| bad(rest));
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
            let raw = u32::from_str_radix(raw_mode, 16).map_err(|_| bad(rest))?;
            let kind = match raw & 0o170000 {
                0o100000 => EntryType::File,
                0o040000 => EntryType::Dir,
                0o120000 => EntryType::Symlink,
                _ => EntryType::Other,
            };
            let secs: i64 = secs.parse().map_err(|_| bad(rest))?;
            let frac = time.split_once('.').map_or("", |(_, f)| f);
            let ns = parse_decimal_ns(&format!("0.{frac}")).unwrap_or(0);
            let size: u64 = size.parse().map_err(|_| bad(rest))?;
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
            let (name, target) = rest.split_once('\0').ok_or_else(|| bad(rest))?;
            let target = target.strip_suffix('\n').unwrap_or(target);
            links.insert(name.trim_start_matches("./").to_owned(), target.to_owned());
        } else if !record.is_empty() {
            return Err(bad(record));
        }
    }
    for e in &mut entries {
        if e.kind == EntryType::Symlink {
            e.link_target = links.remove(e.path.as_str());
        }
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gnu_records() {
        let out = b"d 755 4096 1796007099.9732087980 12 dir with space\0\0f 4644 3 1796007099.5 13 dir with space/f\nnl\0\0l 777 1 1.0 14 ln\0d/f\0";
        let e = parse(out, "\u{1}tok\u{1}").unwrap();
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
        let e = parse(out.as_bytes(), t).unwrap();
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
