//! Where a logical operation's key lives, so that it survives the client: a caller names the operation
//! (`"order-1001/charge"`), the journal gives it a key, durably, before the first send, and the same key
//! every time after, until the caller's horizon. A client that crashes and runs the operation again sends
//! the same key, and the server answers what the first attempt did instead of charging again.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Keys of named operations. Called on a blocking thread, before the first send of a request that
/// names its operation ([`Operation`](crate::Operation)).
pub trait KeyJournal: Send + Sync + 'static {
    /// The key recorded for `operation` while its horizon has not passed; else a new one from `mint`,
    /// recorded durably before it is returned.
    ///
    /// # Errors
    /// The journal could not record a new key; the request is then not sent.
    fn key(&self, operation: &str, mint: &mut dyn FnMut() -> String) -> io::Result<String>;
}

/// Keys that live as long as the process: a retry within it keeps its key, a restart forgets them.
#[derive(Debug)]
pub struct MemoryJournal {
    entries: Mutex<Entries>,
}

impl MemoryJournal {
    /// A journal whose keys are reused for `horizon` after they were minted.
    pub fn new(horizon: Duration) -> Self {
        Self { entries: Mutex::new(Entries::new(horizon)) }
    }
}

impl KeyJournal for MemoryJournal {
    fn key(&self, operation: &str, mint: &mut dyn FnMut() -> String) -> io::Result<String> {
        let mut entries = lock(&self.entries);
        let now = SystemTime::now();
        let (key, minted) = entries.key(operation, now, mint);
        if minted && entries.len() >= entries.next_sweep {
            entries.expire(now);
        }
        Ok(key)
    }
}

/// Keys in an append-only file: one JSON line per new key, flushed to disk (`fsync`) before the key is
/// used, rewritten without the expired ones when it opens and whenever its lines reach twice the keys
/// that were live at the last rewrite. One journal per file (a lock file beside it says so).
#[derive(Debug)]
pub struct FileJournal {
    path: PathBuf,
    /// Held while the journal is open: one writer per file.
    _lock: File,
    state: Mutex<FileState>,
}

#[derive(Debug)]
struct FileState {
    entries: Entries,
    file: File,
    /// Lines in the file, live or not: the file is rewritten with the live ones when they reach
    /// `entries.next_sweep`.
    lines: usize,
}

/// One line of the journal file.
#[derive(serde::Serialize, serde::Deserialize)]
struct Line {
    operation: String,
    key: String,
    /// When the key was minted, in milliseconds since the Unix epoch.
    minted_ms: u64,
}

impl FileJournal {
    /// Opens (or creates) the journal at `path`, keeping keys for `horizon` after they were minted. A
    /// last line cut short by a crash mid-write is dropped: its key was never used, since a key is used
    /// only once its line is on disk. One process per file: a second journal on the same path is refused
    /// while this one is open (a lock file beside it).
    ///
    /// # Errors
    /// The file cannot be read, a line other than the last is not one the journal wrote, another journal
    /// holds the file, or the compacted copy cannot be written in its place.
    pub fn open(path: impl AsRef<Path>, horizon: Duration) -> io::Result<Self> {
        let path = path.as_ref().to_owned();
        let lock = File::create(path.with_extension("lock"))?;
        lock.try_lock().map_err(|_| io::Error::new(io::ErrorKind::WouldBlock, "another journal holds this file"))?;
        let mut entries = Entries::new(horizon);
        match File::open(&path) {
            Ok(file) => read_lines(BufReader::new(file), &mut entries)?,
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        entries.expire(SystemTime::now());
        let file = rewrite(&path, &entries)?;
        let lines = entries.len();
        Ok(Self { path, _lock: lock, state: Mutex::new(FileState { entries, file, lines }) })
    }
}

/// Reads the journal's lines into `entries`. Only the last line may be unreadable (a crash cut it).
fn read_lines(mut reader: impl BufRead, entries: &mut Entries) -> io::Result<()> {
    let mut torn = false;
    let mut line = Vec::new();
    while reader.read_until(b'\n', &mut line)? > 0 {
        if torn {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "an unreadable line inside the journal"));
        }
        match serde_json::from_slice::<Line>(&line) {
            Ok(Line { operation, key, minted_ms }) => {
                entries.insert(operation, key, UNIX_EPOCH + Duration::from_millis(minted_ms));
            }
            Err(_) => torn = true,
        }
        line.clear();
    }
    Ok(())
}

impl KeyJournal for FileJournal {
    fn key(&self, operation: &str, mint: &mut dyn FnMut() -> String) -> io::Result<String> {
        let mut state = lock(&self.state);
        let now = SystemTime::now();
        let (key, minted) = state.entries.key(operation, now, mint);
        if !minted {
            return Ok(key);
        }
        let line = Line { operation: operation.to_owned(), key: key.clone(), minted_ms: millis_since_epoch(now) };
        if let Err(error) = append(&mut state.file, &line) {
            state.entries.remove(operation);
            return Err(error);
        }
        state.lines += 1;
        if state.lines >= state.entries.next_sweep {
            state.entries.expire(now);
            state.file = rewrite(&self.path, &state.entries)?;
            state.lines = state.entries.len();
        }
        Ok(key)
    }
}

/// Appends `line` and flushes it to disk. A write that fails part-way is cut back off, so that the next
/// line does not continue a torn one (and become unreadable with it).
fn append(file: &mut File, line: &Line) -> io::Result<()> {
    let mut bytes = serde_json::to_vec(line).map_err(io::Error::other)?;
    bytes.push(b'\n');
    let length = file.metadata()?.len();
    let written = file.write_all(&bytes).and_then(|()| file.sync_data());
    if written.is_err() {
        let _ = file.set_len(length);
    }
    written
}

/// Writes the live entries to a new file, flushed, then renames it over `path` (and flushes the
/// directory), so a crash leaves either the old journal or the new one. Returns the new file, open for
/// appending.
fn rewrite(path: &Path, entries: &Entries) -> io::Result<File> {
    let staging = path.with_extension("compacting");
    let mut file = File::create(&staging)?;
    for (operation, (key, minted)) in &entries.keys {
        let line = Line { operation: operation.clone(), key: key.clone(), minted_ms: millis_since_epoch(*minted) };
        let mut bytes = serde_json::to_vec(&line).map_err(io::Error::other)?;
        bytes.push(b'\n');
        file.write_all(&bytes)?;
    }
    file.sync_all()?;
    std::fs::rename(&staging, path)?;
    if let Some(directory) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        File::open(directory)?.sync_all()?;
    }
    OpenOptions::new().append(true).open(path)
}

/// Operation → (key, when minted), forgetting keys past the horizon.
#[derive(Debug)]
struct Entries {
    horizon: Duration,
    keys: HashMap<String, (String, SystemTime)>,
    /// When to sweep expired keys next: once the entries (or the file's lines) reach twice what was
    /// live at the last sweep, so that sweeping costs O(1) a key however long the process runs.
    next_sweep: usize,
}

impl Entries {
    fn new(horizon: Duration) -> Self {
        Self { horizon, keys: HashMap::new(), next_sweep: 1024 }
    }

    /// The live key of `operation`, or a new one (`true`: minted now, not yet recorded elsewhere).
    fn key(&mut self, operation: &str, now: SystemTime, mint: &mut dyn FnMut() -> String) -> (String, bool) {
        if let Some((key, minted)) = self.keys.get(operation)
            && !self.expired(*minted, now)
        {
            return (key.clone(), false);
        }
        let key = mint();
        self.keys.insert(operation.to_owned(), (key.clone(), now));
        (key, true)
    }

    /// A key read back from disk: a later line for the same operation wins.
    fn insert(&mut self, operation: String, key: String, minted: SystemTime) {
        self.keys.insert(operation, (key, minted));
    }

    fn remove(&mut self, operation: &str) {
        self.keys.remove(operation);
    }

    fn expire(&mut self, now: SystemTime) {
        let horizon = self.horizon;
        self.keys.retain(|_, (_, minted)| now.duration_since(*minted).unwrap_or_default() < horizon);
        self.next_sweep = (2 * self.keys.len()).max(1024);
    }

    fn expired(&self, minted: SystemTime, now: SystemTime) -> bool {
        now.duration_since(minted).unwrap_or_default() >= self.horizon
    }

    fn len(&self) -> usize {
        self.keys.len()
    }
}

fn millis_since_epoch(at: SystemTime) -> u64 {
    u64::try_from(at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()).unwrap_or(u64::MAX)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic elsewhere mid-update leaves whole entries behind: still usable.
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("key-{n}")
        }
    }

    #[test]
    fn a_file_journal_keeps_keys_across_a_reopen_until_the_horizon() {
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("keys.jsonl");
        let mut mint = counter();
        let journal = FileJournal::open(&path, Duration::from_secs(3600)).expect("open");
        assert_eq!(journal.key("order-1/charge", &mut mint).expect("key"), "key-1");
        assert_eq!(journal.key("order-2/charge", &mut mint).expect("key"), "key-2");
        assert_eq!(journal.key("order-1/charge", &mut mint).expect("key"), "key-1");
        drop(journal);

        // A crash mid-write left half a line: the reopened journal drops it and keeps the rest.
        let mut file = OpenOptions::new().append(true).open(&path).expect("append");
        file.write_all(br#"{"operation":"order-3/charge","ke"#).expect("write");
        drop(file);
        let journal = FileJournal::open(&path, Duration::from_secs(3600)).expect("reopen");
        assert_eq!(journal.key("order-1/charge", &mut mint).expect("key"), "key-1");
        assert_eq!(journal.key("order-3/charge", &mut mint).expect("key"), "key-3");
        drop(journal);

        // Past the horizon, the operation is new again, and the file holds no expired line.
        let expired = FileJournal::open(&path, Duration::ZERO).expect("reopen");
        assert_eq!(expired.key("order-1/charge", &mut mint).expect("key"), "key-4");
        let lines = std::fs::read_to_string(&path).expect("read").lines().count();
        assert_eq!(lines, 1, "only the key minted after the reopen");

        // One journal per file.
        let second = FileJournal::open(&path, Duration::from_secs(3600));
        assert_eq!(second.map(drop).map_err(|e| e.kind()), Err(io::ErrorKind::WouldBlock));
        drop(expired);

        // An unreadable line before the last is not a crash's torn tail: refused, not skipped.
        let mut file = OpenOptions::new().append(true).open(&path).expect("append");
        file.write_all(b"{\"operation\":\"x\"}\n").expect("write");
        file.write_all(b"{\"operation\":\"y\",\"key\":\"k\",\"minted_ms\":1}\n").expect("write");
        drop(file);
        let refused = FileJournal::open(&path, Duration::from_secs(3600)).map(drop).map_err(|e| e.kind());
        assert_eq!(refused, Err(io::ErrorKind::InvalidData));
    }

    #[test]
    fn a_long_running_journal_forgets_expired_keys() {
        let journal = MemoryJournal::new(Duration::ZERO);
        let mut mint = counter();
        for n in 0..5_000 {
            journal.key(&format!("op-{n}"), &mut mint).expect("key");
        }
        assert!(lock(&journal.entries).len() <= 1024, "expired keys are swept as the journal grows");
    }

    #[test]
    fn a_memory_journal_mints_once_per_operation() {
        let journal = MemoryJournal::new(Duration::from_secs(60));
        let mut mint = counter();
        assert_eq!(journal.key("a", &mut mint).expect("key"), "key-1");
        assert_eq!(journal.key("a", &mut mint).expect("key"), "key-1");
        assert_eq!(journal.key("b", &mut mint).expect("key"), "key-2");
    }
}
