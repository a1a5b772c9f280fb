//! A tar writer that writes whatever it is told, for building hostile archives.

/// Special entry kinds.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// Character device.
    Char,
    /// Block device.
    Block,
    /// Named pipe.
    Fifo,
}

/// Builds tar bytes entry by entry, bypassing every check a normal writer makes.
#[derive(Debug, Default)]
pub struct RawTar {
    out: Vec<u8>,
}

impl RawTar {
    /// An empty archive.
    pub fn new() -> Self {
        RawTar::default()
    }

    fn entry(
        self,
        name: &[u8],
        kind: tar::EntryType,
        mode: u32,
        link: Option<&[u8]>,
        data: &[u8],
    ) -> Self {
        let mut h = tar::Header::new_gnu();
        {
            let old = h.as_old_mut();
            let n = name.len().min(old.name.len());
            old.name[..n].copy_from_slice(&name[..n]);
            if let Some(link) = link {
                let n = link.len().min(old.linkname.len());
                old.linkname[..n].copy_from_slice(&link[..n]);
            }
        }
        self.push(h, kind, mode, data)
    }

    /// Fill in the common header fields of `h` and append it with `data`, padded.
    fn push(mut self, mut h: tar::Header, kind: tar::EntryType, mode: u32, data: &[u8]) -> Self {
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        self.out.extend_from_slice(h.as_bytes());
        self.out.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.out.extend(std::iter::repeat_n(0u8, pad));
        self
    }

    /// A regular file.
    pub fn file(self, name: &str, data: &[u8]) -> Self {
        self.entry(name.as_bytes(), tar::EntryType::Regular, 0o644, None, data)
    }

    /// A regular file with a mode.
    pub fn file_mode(self, name: &str, data: &[u8], mode: u32) -> Self {
        self.entry(name.as_bytes(), tar::EntryType::Regular, mode, None, data)
    }

    /// A regular file with a raw (possibly non-UTF-8) name.
    pub fn file_raw(self, name: &[u8], data: &[u8]) -> Self {
        self.entry(name, tar::EntryType::Regular, 0o644, None, data)
    }

    /// A directory.
    pub fn dir(self, name: &str) -> Self {
        self.entry(name.as_bytes(), tar::EntryType::Directory, 0o755, None, &[])
    }

    /// A directory with a mode.
    pub fn dir_mode(self, name: &str, mode: u32) -> Self {
        self.entry(name.as_bytes(), tar::EntryType::Directory, mode, None, &[])
    }

    /// A symlink with a raw (possibly NUL-carrying) target field.
    pub fn symlink_raw(self, name: &str, target: &[u8]) -> Self {
        self.entry(
            name.as_bytes(),
            tar::EntryType::Symlink,
            0o777,
            Some(target),
            &[],
        )
    }

    /// A regular file in a POSIX ustar header whose name is split into the `prefix` and
    /// `name` fields, both raw.
    pub fn ustar_file(self, prefix: &[u8], name: &[u8], data: &[u8]) -> Self {
        let mut h = tar::Header::new_ustar();
        {
            let ustar = h.as_ustar_mut().expect("a ustar header");
            let n = name.len().min(ustar.name.len());
            ustar.name[..n].copy_from_slice(&name[..n]);
            let n = prefix.len().min(ustar.prefix.len());
            ustar.prefix[..n].copy_from_slice(&prefix[..n]);
        }
        self.push(h, tar::EntryType::Regular, 0o644, data)
    }

    /// A symlink.
    pub fn symlink(self, name: &str, target: &str) -> Self {
        self.entry(
            name.as_bytes(),
            tar::EntryType::Symlink,
            0o777,
            Some(target.as_bytes()),
            &[],
        )
    }

    /// A hard link.
    pub fn hardlink(self, name: &str, target: &str) -> Self {
        self.entry(
            name.as_bytes(),
            tar::EntryType::Link,
            0o644,
            Some(target.as_bytes()),
            &[],
        )
    }

    /// A device node or fifo.
    pub fn special(self, name: &str, kind: Kind) -> Self {
        let t = match kind {
            Kind::Char => tar::EntryType::Char,
            Kind::Block => tar::EntryType::Block,
            Kind::Fifo => tar::EntryType::Fifo,
        };
        self.entry(name.as_bytes(), t, 0o644, None, &[])
    }

    /// A file whose (long) name travels in a GNU long-name extension entry.
    pub fn long_name(self, name: &str, data: &[u8]) -> Self {
        let mut ext = name.as_bytes().to_vec();
        ext.push(0);
        self.entry(
            b"././@LongLink",
            tar::EntryType::GNULongName,
            0o644,
            None,
            &ext,
        )
        .entry(b"placeholder", tar::EntryType::Regular, 0o644, None, data)
    }

    /// A file whose path is overridden by a pax extended header.
    pub fn pax_path(self, pax_path: &str, name: &str, data: &[u8]) -> Self {
        let body = format!("path={pax_path}\n");
        // A pax record is "<len> <key>=<value>\n" where len counts itself.
        let mut len = body.len() + 2;
        loop {
            let rec = format!("{len} {body}");
            if rec.len() == len {
                break;
            }
            len = rec.len();
        }
        let record = format!("{len} {body}");
        self.entry(
            b"PaxHeader",
            tar::EntryType::XHeader,
            0o644,
            None,
            record.as_bytes(),
        )
        .entry(name.as_bytes(), tar::EntryType::Regular, 0o644, None, data)
    }

    /// The archive bytes, with the end-of-archive blocks.
    pub fn finish(mut self) -> Vec<u8> {
        self.out.extend(std::iter::repeat_n(0u8, 1024));
        self.out
    }
}
