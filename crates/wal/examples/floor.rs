//! The floor: what a replicated, synced log entry costs on this machine when nothing but its messages
//! and syncs is done, measured, to hold Holdfast's figures against (docs/performance.md, "The floor").
//!
//! `scripts/floor-figures [--clients "1 64 256"] [--duration 10] [--runs 3] [--dir DIR] [--pipelined]
//! [--over-zeros]`
//! (which builds this example in release and runs it as `floor run ...`) starts five server processes
//! and a load generator, all of them this program in other roles, on loopback TCP and files in the
//! temporary directory (`--dir DIR` for another; it must be on a disk, not tmpfs, where `fdatasync`
//! does nothing), as `holdfast dev` and `holdfast bench` do. The load generator runs one thread per
//! client, each with a connection of its own, each sending one 64-byte request at a time, two per pair
//! (as an acquire and its release). Each server does only the messages and syncs the design asks of
//! every log entry:
//! - a follower reads a batch, writes it to its file (appended, or over zeros: below), `fdatasync`s,
//!   and answers with its last index;
//! - the leader sends each follower whose previous batch is answered (one batch in flight per
//!   follower, as Holdfast replicates) every entry it has not had, writes the entries to its own file
//!   and `fdatasync`s them, and answers a request once its entry is synced there and by two followers
//!   (it keeps in memory the entries some follower has not been sent, and drops the rest in steps of
//!   [`TRIM_ENTRIES`]).
//!
//! The leader works in one of two ways. By default in lock-step: it takes the requests that have
//! arrived as a batch, sends, syncs, waits for the quorum and answers, and only then takes more. That
//! makes its batches as large as they can be, so its CPU per entry under load is as low as this shape
//! allows, and its latency under load higher. With `--pipelined`, as Holdfast's leader: it goes on
//! taking and sending requests while earlier ones sync and replicate, and a thread of its own writes
//! and syncs the log (everything queued in one sync, as Holdfast's WAL thread does).
//!
//! No Raft (no terms, votes or log matching), no lock table, no encoding, no async runtime: each
//! follower is one thread, and the leader one (two when pipelined), blocking in `poll`, `read` or
//! `fdatasync`, so they sleep and wake only where the pattern must. Each role appends to its log, so
//! that each sync also makes the file's new length durable; with `--over-zeros` each writes its log in
//! place over zeros written and synced before the run, as Holdfast's WAL does (no sync then changes
//! the file's size or its blocks). Other shapes (`RWF_DSYNC` writes) are not measured. What these
//! figures spend is the machine's (the kernel's loopback TCP, its wake-ups and the disk) for this
//! shape; what Holdfast spends beyond them is its own.
//!
//! It prints, per client count, the medians of RUNS runs of DURATION seconds (after a 1 s warm-up):
//! pairs/s, the pair's p50 and p99, the five servers' CPU time per log entry and the leader's part of
//! it (from `/proc/PID/task/*/schedstat`), their context switches per entry
//! (`/proc/PID/task/*/status`, voluntary and not), the load generator's CPU per entry (from its start
//! to the end of the measured time), and the leader's entries per sync. The servers' CPU and switches
//! are counted as `scripts/bench-figures` counts Holdfast's: over the load generator's whole run
//! (connecting, the warm-up, the measured time and the last answers), divided by the entries of the
//! measured time, so both include the warm-up's ~10% alike (the CPU from `schedstat` in ns where
//! bench-figures reads `/proc/PID/stat` in ticks: the same time, finer).

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A request: an 8-byte id and 56 bytes of payload, about an acquire's encoded command.
const REQUEST_BYTES: usize = 64;
/// Followers, and the answers the leader waits for (with its own sync, 3 of 5).
const FOLLOWERS: usize = 4;
const QUORUM_OF_FOLLOWERS: usize = 2;
const WARM_UP: Duration = Duration::from_secs(1);
/// Entries every follower has been sent that the leader drops at once: 4 MiB, so the drop (a copy of
/// what is left) comes seldom and the log stays a few MiB at any speed.
const TRIM_ENTRIES: u64 = 65_536;
/// How long a run may take beyond its warm-up and measured time before `run` gives up on it (a role
/// that hangs): a run ends within a second of its measured time, so a minute is plainly a hang.
const RUN_SLACK: Duration = Duration::from_secs(60);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("follower") => takes(&args, 1).and_then(|()| follower(Path::new(&args[1]))),
        Some("leader") => takes(&args, 3 + FOLLOWERS).and_then(|()| leader(&args[1..])),
        Some("client") => takes(&args, 3).and_then(|()| client(&args[1..])),
        Some("run") | None => run(&args[args.len().min(1)..]),
        Some(other) => Err(io::Error::other(format!("unknown role {other}"))),
    };
    if let Err(e) = result {
        eprintln!("floor: {e}");
        std::process::exit(1);
    }
}

/// The roles are started by `run` with their arguments: says so rather than index past the end.
fn takes(args: &[String], n: usize) -> io::Result<()> {
    if args.len() > n {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "the {} role takes {n} arguments from `run`",
            args[0]
        )))
    }
}

/// Listens on a port of the system's choosing and says which on stdout, for `run` to read.
fn listen() -> io::Result<TcpListener> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    io::stdout().flush()?;
    Ok(listener)
}

fn follower(dir: &Path) -> io::Result<()> {
    // Before the port is said, so that writing the zeros (`--over-zeros`) is not counted.
    let mut file = open_log(dir, &format!("follower-{}", std::process::id()))?;
    let listener = listen()?;
    let (socket, _) = listener.accept()?;
    socket.set_nodelay(true)?;
    let mut writer = socket.try_clone()?;
    // Reads ahead, so a batch that arrived whole is one `recv`.
    let mut reader = BufReader::with_capacity(64 << 10, socket);
    let mut header = [0u8; 12];
    let mut body = Vec::new();
    loop {
        match reader.read_exact(&mut header) {
            Ok(()) => {}
            // The leader closed (with an answer unread, a close is a reset).
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
                ) =>
            {
                return Ok(())
            }
            Err(e) => return Err(e),
        }
        let len = u32::from_le_bytes(header[..4].try_into().unwrap()) as usize;
        let last = &header[4..12];
        body.resize(len, 0);
        reader.read_exact(&mut body)?;
        file.write_all(&body)?;
        file.sync_data()?;
        writer.write_all(last)?;
    }
}

struct Peer {
    socket: TcpStream,
    /// Entries sent to it, and entries it has synced.
    sent: u64,
    acked: u64,
}

struct Caller {
    socket: TcpStream,
    pending: Vec<u8>,
    open: bool,
}

/// The leader's entries from `base` on: a follower that falls behind is sent all it has not had.
struct Log {
    bytes: Vec<u8>,
    base: u64,
}

impl Log {
    /// Entries appended so far.
    fn end(&self) -> u64 {
        self.base + (self.bytes.len() / REQUEST_BYTES) as u64
    }

    /// The entries from `from` up to `end`.
    fn range(&self, from: u64, end: u64) -> &[u8] {
        &self.bytes[(from - self.base) as usize * REQUEST_BYTES
            ..(end - self.base) as usize * REQUEST_BYTES]
    }

    /// Drops what every follower has been sent, in steps of [`TRIM_ENTRIES`].
    fn trim(&mut self, peers: &[Peer]) {
        let sent_to_all = peers.iter().map(|p| p.sent).min().unwrap_or(self.base);
        if sent_to_all - self.base >= TRIM_ENTRIES {
            self.bytes
                .drain(..(sent_to_all - self.base) as usize * REQUEST_BYTES);
            self.base = sent_to_all;
        }
    }
}

/// A request taken into the log and not answered yet: its caller, its id, and its entry's number
/// (the log's end once it was appended).
type Waiting = std::collections::VecDeque<(usize, [u8; 8], u64)>;

/// `leader DIR CLIENTS MODE PORT PORT PORT PORT`, MODE `lock-step` or `pipelined`. Says `batches
/// SYNCS ENTRIES` when its callers have all closed.
fn leader(args: &[String]) -> io::Result<()> {
    let dir = Path::new(&args[0]);
    let clients: usize = args[1].parse().map_err(io::Error::other)?;
    let pipelined = match args[2].as_str() {
        "lock-step" => false,
        "pipelined" => true,
        other => return Err(io::Error::other(format!("unknown leader mode {other}"))),
    };
    // Before the port is said, so that writing the zeros (`--over-zeros`) is not counted.
    let file = open_log(dir, "leader")?;
    let mut peers = Vec::new();
    for port in &args[3..3 + FOLLOWERS] {
        let socket =
            TcpStream::connect(("127.0.0.1", port.parse::<u16>().map_err(io::Error::other)?))?;
        socket.set_nodelay(true)?;
        peers.push(Peer {
            socket,
            sent: 0,
            acked: 0,
        });
    }
    let listener = listen()?;
    let mut callers = Vec::new();
    for _ in 0..clients {
        let (socket, _) = listener.accept()?;
        socket.set_nodelay(true)?;
        callers.push(Caller {
            socket,
            pending: Vec::new(),
            open: true,
        });
    }
    let (syncs, entries) = if pipelined {
        pipelined_leader(file, peers, callers)?
    } else {
        lock_step_leader(file, peers, callers)?
    };
    println!("batches {syncs} {entries}");
    Ok(())
}

/// Takes every whole request from the callers `fds` says are readable (`fds` holds a pollfd per open
/// caller, in order) into `log` and `waiting`; a caller that closed is marked so.
fn take_requests(
    callers: &mut [Caller],
    fds: &[libc::pollfd],
    buf: &mut [u8],
    log: &mut Log,
    waiting: &mut Waiting,
) -> io::Result<()> {
    let mut polled = fds.iter();
    for (i, caller) in callers.iter_mut().enumerate().filter(|(_, c)| c.open) {
        if polled.next().is_some_and(|fd| fd.revents != 0) {
            let n = caller.socket.read(buf)?;
            if n == 0 {
                caller.open = false;
                continue;
            }
            caller.pending.extend_from_slice(&buf[..n]);
            let whole = caller.pending.len() / REQUEST_BYTES * REQUEST_BYTES;
            for request in caller.pending[..whole].chunks_exact(REQUEST_BYTES) {
                log.bytes.extend_from_slice(request);
                waiting.push_back((i, request[..8].try_into().unwrap(), log.end()));
            }
            caller.pending.drain(..whole);
        }
    }
    Ok(())
}

/// Answers the waiting requests whose entries are among the first `committed`.
fn answer(callers: &mut [Caller], waiting: &mut Waiting, committed: u64) -> io::Result<()> {
    while let Some(&(i, id, entry)) = waiting.front() {
        if entry > committed {
            break;
        }
        waiting.pop_front();
        if callers[i].open {
            callers[i].socket.write_all(&id)?;
        }
    }
    Ok(())
}

/// Polls the followers, then `extra` (if any), then the open callers.
fn poll_all(
    fds: &mut Vec<libc::pollfd>,
    peers: &[Peer],
    extra: Option<libc::pollfd>,
    callers: &[Caller],
) -> io::Result<()> {
    fds.clear();
    fds.extend(peers.iter().map(|p| pollfd(&p.socket)));
    fds.extend(extra);
    fds.extend(callers.iter().filter(|c| c.open).map(|c| pollfd(&c.socket)));
    poll(fds)
}

/// Sends each follower with nothing in flight what it has not had, up to the log's end.
fn send_to_idle(peers: &mut [Peer], log: &Log, frame: &mut Vec<u8>) -> io::Result<()> {
    let end = log.end();
    for peer in peers
        .iter_mut()
        .filter(|p| p.sent == p.acked && p.sent < end)
    {
        let body = log.range(peer.sent, end);
        frame.clear();
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&end.to_le_bytes());
        frame.extend_from_slice(body);
        peer.socket.write_all(frame)?;
        peer.sent = end;
    }
    Ok(())
}

/// Entries that [`QUORUM_OF_FOLLOWERS`] followers have synced.
fn acked_by_quorum(peers: &[Peer]) -> u64 {
    let mut acked: Vec<u64> = peers.iter().map(|p| p.acked).collect();
    acked.sort_unstable_by(|a, b| b.cmp(a));
    acked[QUORUM_OF_FOLLOWERS - 1]
}

/// Lock-step: takes the requests that have arrived, sends them, syncs them, waits for the quorum,
/// answers them, and only then takes more. Returns its syncs and entries.
fn lock_step_leader(
    mut file: LogFile,
    mut peers: Vec<Peer>,
    mut callers: Vec<Caller>,
) -> io::Result<(u64, u64)> {
    let mut log = Log {
        bytes: Vec::new(),
        base: 0,
    };
    let mut waiting = Waiting::new();
    let (mut frame, mut fds, mut buf) = (Vec::new(), Vec::new(), vec![0u8; 64 << 10]);
    let mut syncs = 0;
    while callers.iter().any(|c| c.open) {
        // Wait for requests (and take the answers of followers behind the last quorum).
        poll_all(&mut fds, &peers, None, &callers)?;
        take_acks(&mut peers, &fds[..FOLLOWERS])?;
        let start = log.bytes.len();
        take_requests(
            &mut callers,
            &fds[FOLLOWERS..],
            &mut buf,
            &mut log,
            &mut waiting,
        )?;
        if log.bytes.len() == start {
            continue;
        }
        let end = log.end();
        // To every follower with nothing in flight, then our own write and sync meanwhile.
        send_to_idle(&mut peers, &log, &mut frame)?;
        file.write_all(&log.bytes[start..])?;
        file.sync_data()?;
        syncs += 1;
        while acked_by_quorum(&peers) < end {
            poll_all(&mut fds, &peers, None, &[])?;
            take_acks(&mut peers, &fds)?;
            send_to_idle(&mut peers, &log, &mut frame)?;
        }
        answer(&mut callers, &mut waiting, end)?;
        log.trim(&peers);
    }
    Ok((syncs, log.end()))
}

/// Pipelined, as Holdfast's leader: a thread of its own writes and syncs the log (all that is queued
/// in one sync, as Holdfast's WAL thread does) and says how far it has synced on a socket the leader
/// polls, while the leader goes on taking requests and sending them. A request is answered once its
/// entry is synced here and by two followers. Returns its syncs and entries.
fn pipelined_leader(
    mut file: LogFile,
    mut peers: Vec<Peer>,
    mut callers: Vec<Caller>,
) -> io::Result<(u64, u64)> {
    let (queue, queued) = std::sync::mpsc::channel::<(Vec<u8>, u64)>();
    let (mut synced_rx, mut synced_tx) = std::os::unix::net::UnixStream::pair()?;
    let writer = std::thread::spawn(move || -> io::Result<u64> {
        let mut syncs = 0;
        while let Ok((bytes, mut end)) = queued.recv() {
            file.write_all(&bytes)?;
            while let Ok((more, more_end)) = queued.try_recv() {
                file.write_all(&more)?;
                end = more_end;
            }
            file.sync_data()?;
            syncs += 1;
            synced_tx.write_all(&end.to_le_bytes())?;
        }
        Ok(syncs)
    });
    // The leader's part; when it fails because the writer stopped, the writer's error says why.
    let led = (|| -> io::Result<u64> {
        let mut log = Log {
            bytes: Vec::new(),
            base: 0,
        };
        let mut waiting = Waiting::new();
        let (mut frame, mut fds, mut buf) = (Vec::new(), Vec::new(), vec![0u8; 64 << 10]);
        let (mut synced, mut notices) = (0u64, Vec::new());
        while callers.iter().any(|c| c.open) {
            poll_all(&mut fds, &peers, Some(pollfd(&synced_rx)), &callers)?;
            take_acks(&mut peers, &fds[..FOLLOWERS])?;
            if fds[FOLLOWERS].revents != 0 {
                let n = synced_rx.read(&mut buf)?;
                if n == 0 {
                    return Err(io::Error::other("the log writer stopped"));
                }
                // Each notice is 8 bytes and they only grow: the last whole one is the latest.
                notices.extend_from_slice(&buf[..n]);
                let whole = notices.len() / 8 * 8;
                if let Some(last) = notices[..whole].chunks_exact(8).last() {
                    synced = u64::from_le_bytes(last.try_into().unwrap());
                }
                notices.drain(..whole);
            }
            let start = log.bytes.len();
            take_requests(
                &mut callers,
                &fds[FOLLOWERS + 1..],
                &mut buf,
                &mut log,
                &mut waiting,
            )?;
            if log.bytes.len() > start {
                queue
                    .send((log.bytes[start..].to_vec(), log.end()))
                    .map_err(|_| io::Error::other("the log writer stopped"))?;
            }
            send_to_idle(&mut peers, &log, &mut frame)?;
            answer(
                &mut callers,
                &mut waiting,
                synced.min(acked_by_quorum(&peers)),
            )?;
            log.trim(&peers);
        }
        Ok(log.end())
    })();
    drop(queue);
    let written = writer
        .join()
        .map_err(|_| io::Error::other("the log writer panicked"))?;
    match (led, written) {
        (Ok(entries), Ok(syncs)) => Ok((syncs, entries)),
        (_, Err(e)) | (Err(e), Ok(_)) => Err(e),
    }
}

fn take_acks(peers: &mut [Peer], fds: &[libc::pollfd]) -> io::Result<()> {
    for (peer, fd) in peers.iter_mut().zip(fds) {
        if fd.revents != 0 {
            let mut ack = [0u8; 8];
            peer.socket.read_exact(&mut ack)?;
            peer.acked = u64::from_le_bytes(ack);
        }
    }
    Ok(())
}

/// Waits for `socket` to be readable (or closed).
fn pollfd(socket: &impl AsRawFd) -> libc::pollfd {
    libc::pollfd {
        fd: socket.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Blocks until one of `fds` is readable (or closed).
#[allow(unsafe_code, reason = "poll(2) has no safe wrapper in std")]
fn poll(fds: &mut [libc::pollfd]) -> io::Result<()> {
    loop {
        // SAFETY: `fds` is a valid, exclusively borrowed slice of `pollfd` for the call's duration,
        // and its length is passed with it.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The bytes of zeros a log is written over with `run --over-zeros`: more than the largest run writes
/// at one client; a log that reaches its end goes on from its start.
const ZEROS_BYTES: u64 = 64 << 20;

/// A role's log: appended to, so that each sync also makes the file's new length durable, or with
/// `run --over-zeros` (which sets `FLOOR_OVER_ZEROS` for the roles) written in place over zeros that
/// were written and synced before the role said its port, so that no sync changes the file's size or
/// its blocks, as Holdfast's WAL writes (docs/performance.md, "Syncs that do not grow the file").
struct LogFile {
    file: File,
    /// Where the next write goes when written over zeros.
    over_zeros_at: Option<u64>,
}

impl Write for LogFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let Some(at) = &mut self.over_zeros_at else {
            return self.file.write(buf);
        };
        if *at >= ZEROS_BYTES {
            *at = 0;
        }
        let len = buf.len().min((ZEROS_BYTES - *at) as usize);
        let written = std::os::unix::fs::FileExt::write_at(&self.file, &buf[..len], *at)?;
        *at += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl LogFile {
    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

fn open_log(dir: &Path, name: &str) -> io::Result<LogFile> {
    let path = dir.join(format!("{name}.log"));
    if std::env::var_os("FLOOR_OVER_ZEROS").is_none() {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        return Ok(LogFile {
            file,
            over_zeros_at: None,
        });
    }
    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(path)?;
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..ZEROS_BYTES / zeros.len() as u64 {
        file.write_all(&zeros)?;
    }
    file.sync_all()?;
    Ok(LogFile {
        file,
        over_zeros_at: Some(0),
    })
}

/// `client PORT CLIENTS DURATION_MS`: says `measuring` when the warm-up ends and `done` when the
/// measured time does, then waits for a line on stdin (so that `run` reads this process's CPU time
/// while all its threads still run), stops, and says `result PAIRS P50_US P99_US`. Then it waits for
/// another line before it closes its connections (which ends the leader, and the leader's close the
/// followers), so that `run` reads the servers' CPU time while they still run.
fn client(args: &[String]) -> io::Result<()> {
    let port: u16 = args[0].parse().map_err(io::Error::other)?;
    let clients: usize = args[1].parse().map_err(io::Error::other)?;
    let duration = Duration::from_millis(args[2].parse().map_err(io::Error::other)?);
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for t in 0..clients {
        let mut socket = TcpStream::connect(("127.0.0.1", port))?;
        socket.set_nodelay(true)?;
        let (measuring, stop) = (measuring.clone(), stop.clone());
        threads.push(std::thread::spawn(
            move || -> io::Result<(Vec<u32>, TcpStream)> {
                let mut request = [7u8; REQUEST_BYTES];
                let mut answer = [0u8; 8];
                let mut latencies = Vec::new();
                let mut id = (t as u64) << 40;
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    for _ in 0..2 {
                        id += 1;
                        request[..8].copy_from_slice(&id.to_le_bytes());
                        socket.write_all(&request)?;
                        socket.read_exact(&mut answer)?;
                        if answer != id.to_le_bytes() {
                            return Err(io::Error::other("an answer to another request"));
                        }
                    }
                    if measuring.load(Ordering::Relaxed) {
                        latencies.push(started.elapsed().as_micros() as u32);
                    }
                }
                Ok((latencies, socket))
            },
        ));
    }
    std::thread::sleep(WARM_UP);
    measuring.store(true, Ordering::Relaxed);
    println!("measuring");
    io::stdout().flush()?;
    std::thread::sleep(duration);
    measuring.store(false, Ordering::Relaxed);
    println!("done");
    io::stdout().flush()?;
    io::stdin().read_line(&mut String::new())?;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut sockets = Vec::new();
    for thread in threads {
        let (latencies, socket) = thread
            .join()
            .map_err(|_| io::Error::other("a client thread panicked"))??;
        all.extend(latencies);
        sockets.push(socket);
    }
    all.sort_unstable();
    let at = |q: f64| all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)));
    println!(
        "result {} {} {}",
        all.len(),
        at(0.50).copied().unwrap_or(0),
        at(0.99).copied().unwrap_or(0)
    );
    io::stdout().flush()?;
    io::stdin().read_line(&mut String::new())?;
    drop(sockets);
    Ok(())
}

/// A child process of this program, killed if still running when dropped.
struct Role {
    /// `follower`, `leader` or `client`, and its pid: for errors.
    name: String,
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Role {
    fn start(args: &[&str]) -> io::Result<Role> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let out = BufReader::new(child.stdout.take().expect("piped"));
        let name = format!("the {} (pid {})", args[0], child.id());
        Ok(Role { name, child, out })
    }

    fn line(&mut self) -> io::Result<String> {
        let mut line = String::new();
        if self.out.read_line(&mut line)? == 0 {
            return Err(io::Error::other(format!("{} ended early", self.name)));
        }
        Ok(line.trim().to_string())
    }

    /// Writes a line to the role's stdin.
    fn tell(&mut self, line: &str) -> io::Result<()> {
        let stdin = self.child.stdin.as_mut().expect("piped");
        stdin.write_all(line.as_bytes())?;
        stdin.write_all(b"\n")?;
        stdin.flush()
    }

    fn expect(&mut self, what: &str) -> io::Result<()> {
        let line = self.line()?;
        if line == what {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "{}: expected {what}, got {line:?}",
                self.name
            )))
        }
    }

    fn finish(&mut self) -> io::Result<()> {
        let status = self.child.wait()?;
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "{} ended with {status}",
                self.name
            )))
        }
    }

    fn port(&mut self) -> io::Result<String> {
        let line = self.line()?;
        line.strip_prefix("port ")
            .map(str::to_string)
            .ok_or_else(|| {
                io::Error::other(format!("{}: expected a port, got {line:?}", self.name))
            })
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU time in ns and context switches, summed over a process's threads.
fn usage(pid: u32) -> io::Result<(u64, u64)> {
    let (mut ns, mut switches) = (0, 0);
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?.path();
        let Ok(schedstat) = std::fs::read_to_string(task.join("schedstat")) else {
            continue; // a thread that just ended
        };
        ns += schedstat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| {
                io::Error::other(format!("{}: unreadable {schedstat:?}", task.display()))
            })?;
        let status = std::fs::read_to_string(task.join("status")).unwrap_or_default();
        for line in status.lines() {
            if let Some(v) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                switches += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    Ok((ns, switches))
}

fn usage_of(pids: &[u32]) -> io::Result<(u64, u64)> {
    pids.iter().try_fold((0, 0), |(ns, sw), &pid| {
        let (n, s) = usage(pid)?;
        Ok((ns + n, sw + s))
    })
}

struct Figures {
    pairs_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    server_ms_per_entry: f64,
    leader_ms_per_entry: f64,
    switches_per_entry: f64,
    client_ms_per_entry: f64,
    entries_per_sync: f64,
}

fn run_once(base: &Path, clients: usize, duration: Duration, mode: &str) -> io::Result<Figures> {
    let dir = base.join(format!("holdfast-floor-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let dir_arg = dir.to_string_lossy().into_owned();
    let result = (|| {
        let mut followers = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..FOLLOWERS {
            let mut role = Role::start(&["follower", &dir_arg])?;
            ports.push(role.port()?);
            followers.push(role);
        }
        let clients_arg = clients.to_string();
        let mut args = vec!["leader", &dir_arg, &clients_arg, mode];
        args.extend(ports.iter().map(String::as_str));
        let mut leader = Role::start(&args)?;
        let port = leader.port()?;
        let servers: Vec<u32> = followers
            .iter()
            .chain([&leader])
            .map(|r| r.child.id())
            .collect();
        let leader_pid = leader.child.id();
        let (finished, watch) = std::sync::mpsc::channel::<()>();
        let limit = WARM_UP + duration + RUN_SLACK;
        let pids: Vec<String> = servers.iter().map(u32::to_string).collect();
        let files = dir.clone();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = watch.recv_timeout(limit) {
                // Said first: the kills make the run's own reads fail, and it may end the process
                // before this thread does.
                eprintln!(
                    "floor: a run took over {limit:?}, so a role hangs: killing the servers (the load generator ends with them)"
                );
                let _ = Command::new("kill").arg("-9").args(&pids).status();
                let _ = std::fs::remove_dir_all(&files);
                std::process::exit(1);
            }
        });
        // Counted as scripts/bench-figures counts Holdfast's: from before the load generator starts
        // until its last answer.
        let (server_before, leader_before) = (usage_of(&servers)?, usage(leader_pid)?);
        let ms = duration.as_millis().to_string();
        let mut load = Role::start(&["client", &port, &clients_arg, &ms])?;
        load.expect("measuring")?;
        load.expect("done")?;
        // The load generator's own, from its start to the end of the measured time.
        let client = usage(load.child.id())?;
        load.tell("stop")?;
        let fields = numbers(&load.line()?, "result ")?;
        let (server_after, leader_after) = (usage_of(&servers)?, usage(leader_pid)?);
        // The roles end by themselves once the load generator closes its connections.
        load.tell("exit")?;
        let batches = numbers(&leader.line()?, "batches ")?;
        for role in [&mut load, &mut leader]
            .into_iter()
            .chain(followers.iter_mut())
        {
            role.finish()?;
        }
        drop(finished);
        let pairs = fields[0];
        let entries = (2.0 * pairs).max(1.0);
        Ok(Figures {
            pairs_per_s: pairs / duration.as_secs_f64(),
            p50_ms: fields[1] / 1000.0,
            p99_ms: fields[2] / 1000.0,
            server_ms_per_entry: (server_after.0 - server_before.0) as f64 / 1e6 / entries,
            leader_ms_per_entry: (leader_after.0 - leader_before.0) as f64 / 1e6 / entries,
            switches_per_entry: (server_after.1 - server_before.1) as f64 / entries,
            client_ms_per_entry: client.0 as f64 / 1e6 / entries,
            entries_per_sync: batches[1] / batches[0].max(1.0),
        })
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The numbers after `prefix` in a role's line.
fn numbers(line: &str, prefix: &str) -> io::Result<Vec<f64>> {
    line.strip_prefix(prefix)
        .ok_or_else(|| io::Error::other(format!("expected {prefix:?}, got {line:?}")))?
        .split_whitespace()
        .map(|v| v.parse::<f64>().map_err(io::Error::other))
        .collect()
}

/// The middle value, or the mean of the two middle ones (as Python's `statistics.median`).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Refuses a directory on tmpfs or ramfs, where `fdatasync` writes nothing to a disk.
fn on_a_disk(dir: &Path) -> io::Result<()> {
    let dir = dir
        .canonicalize()
        .map_err(|e| io::Error::other(format!("{}: {e}", dir.display())))?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
    // The mount point of `dir` is the longest one it is under; its type follows the " - ".
    let fs = mounts
        .lines()
        .filter_map(|line| {
            let point = line.split(' ').nth(4)?;
            let kind = line.split(" - ").nth(1)?.split(' ').next()?;
            dir.starts_with(point).then_some((point.len(), kind))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, kind)| kind);
    match fs {
        Some(kind @ ("tmpfs" | "ramfs")) => Err(io::Error::other(format!(
            "{} is on {kind}, where fdatasync does nothing: give --dir a directory on a disk",
            dir.display()
        ))),
        _ => Ok(()),
    }
}

fn parsed<T: std::str::FromStr>(flag: &str, value: &str) -> io::Result<T>
where
    T::Err: std::fmt::Display,
{
    value
        .parse()
        .map_err(|e| io::Error::other(format!("{flag} {value}: {e}")))
}

/// `run [--clients "1 64 256"] [--duration SECS] [--runs N] [--dir DIR] [--pipelined] [--over-zeros]`.
fn run(args: &[String]) -> io::Result<()> {
    let mut clients = vec![1usize, 64, 256];
    let mut duration = Duration::from_secs(10);
    let mut runs = 3;
    let mut dir = std::env::temp_dir();
    let mut mode = "lock-step";
    let mut shape = "logs appended to";
    let mut args = args.iter();
    while let Some(flag) = args.next() {
        if matches!(flag.as_str(), "--help" | "-h") {
            println!(
                "floor run [--clients \"1 64 256\"] [--duration SECS] [--runs N] [--dir DIR] [--pipelined] [--over-zeros] (docs/performance.md, \"The floor\")"
            );
            return Ok(());
        }
        if flag == "--pipelined" {
            mode = "pipelined";
            continue;
        }
        if flag == "--over-zeros" {
            // Read by the roles' `open_log`; set before any of them starts (and before this
            // process has a second thread).
            std::env::set_var("FLOOR_OVER_ZEROS", "1");
            shape = "logs written over zeros";
            continue;
        }
        let value = args
            .next()
            .ok_or_else(|| io::Error::other(format!("{flag} needs a value")))?;
        match flag.as_str() {
            "--clients" => {
                clients = value
                    .split_whitespace()
                    .map(|v| parsed(flag, v))
                    .collect::<io::Result<_>>()?
            }
            // Seconds, with or without the `s` that scripts/bench-figures' --duration takes.
            "--duration" => {
                duration = Duration::from_secs(parsed(flag, value.trim_end_matches('s'))?)
            }
            "--runs" => runs = parsed(flag, value)?,
            "--dir" => dir = PathBuf::from(value),
            _ => return Err(io::Error::other(format!("unknown flag {flag}"))),
        }
    }
    if clients.contains(&0) || duration.is_zero() || runs == 0 {
        return Err(io::Error::other(
            "--clients, --duration and --runs take numbers above 0",
        ));
    }
    on_a_disk(&dir)?;
    println!("the floor, leader {mode}, {shape}:");
    println!(
        "| clients | pairs/s | pair p50 / p99 ms | servers' CPU ms per entry (the leader's) | switches per entry | load generator's CPU ms per entry | entries per leader sync |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &n in &clients {
        let mut all = Vec::new();
        for _ in 0..runs {
            all.push(run_once(&dir, n, duration, mode)?);
        }
        let m = |f: fn(&Figures) -> f64| median(all.iter().map(f).collect());
        println!(
            "| {n} | {:.0} | {:.2} / {:.2} | {:.3} ({:.3}) | {:.1} | {:.3} | {:.1} |",
            m(|f| f.pairs_per_s),
            m(|f| f.p50_ms),
            m(|f| f.p99_ms),
            m(|f| f.server_ms_per_entry),
            m(|f| f.leader_ms_per_entry),
            m(|f| f.switches_per_entry),
            m(|f| f.client_ms_per_entry),
            m(|f| f.entries_per_sync),
        );
    }
    Ok(())
}
