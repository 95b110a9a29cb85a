//! Length-framed protobuf messages on a byte stream, for the protocols Holdfast speaks outside gRPC on
//! its ports (the `Calls` connections of `holdfast-server`'s `raw_calls` and the client's `calls`).
//!
//! A frame is a u32 little-endian length, then that many bytes of one message. [`FrameReader`] reads
//! them as they arrive, several per read when they came together, into one buffer it reuses: it never
//! allocates from a length it was sent (a frame grows the buffer only as its bytes arrive), and a
//! length above its limit is an error before anything of that frame is read.

use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, ReadBuf};

/// Bytes read at most per read when no frame is waiting for more (a frame in progress reads what it
/// lacks, up to its length).
const READ_CHUNK: usize = 16 << 10;

/// Appends `m` as one frame to `out`.
pub fn encode<M: prost::Message>(m: &M, out: &mut Vec<u8>) {
    let len = m.encoded_len();
    out.reserve(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    m.encode(out).expect("a Vec grows to fit");
}

/// The frames of a byte stream, each decoded as an `M`; ends (`None`) when the stream ends between
/// frames. A stream that ends inside a frame, a frame over the limit, one that does not decode, or
/// (with [`FrameReader::idle`]) nothing read for that long, is an error, after which it yields nothing.
pub struct FrameReader<R, M> {
    io: R,
    /// Bytes read: `buf[start..end]` are not taken yet; reads go into `buf[end..]` (initialized once,
    /// when the buffer grows).
    buf: Vec<u8>,
    start: usize,
    end: usize,
    max: usize,
    idle: Option<Idle>,
    done: bool,
    _m: PhantomData<fn() -> M>,
}

struct Idle {
    after: Duration,
    last_read: tokio::time::Instant,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl<R: AsyncRead + Unpin, M: prost::Message + Default> FrameReader<R, M> {
    /// Frames of at most `max` bytes (not counting the length).
    pub fn new(io: R, max: usize) -> Self {
        FrameReader {
            io,
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
            max,
            idle: None,
            done: false,
            _m: PhantomData,
        }
    }

    /// Fails with `TimedOut` once nothing at all has been read for `after`.
    pub fn idle(mut self, after: Duration) -> Self {
        let last_read = tokio::time::Instant::now();
        self.idle = Some(Idle {
            after,
            last_read,
            timer: Box::pin(tokio::time::sleep_until(last_read + after)),
        });
        self
    }

    /// The length of the frame `buf[start..end]` begins with, once its 4 bytes are there.
    fn next_len(&self) -> Option<usize> {
        if self.end - self.start < 4 {
            return None;
        }
        let head = &self.buf[self.start..self.start + 4];
        Some(u32::from_le_bytes(head.try_into().expect("4 bytes")) as usize)
    }

    /// The frame that `buf[start..end]` begins with, if all of it is there.
    fn take(&mut self) -> Option<io::Result<M>> {
        let have = self.end - self.start;
        let len = self.next_len()?;
        if len > self.max {
            return Some(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a frame of {len} bytes, over the limit of {}", self.max),
            )));
        }
        if have < 4 + len {
            return None;
        }
        let body = &self.buf[self.start + 4..self.start + 4 + len];
        let m = M::decode(body)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("a bad frame: {e}")));
        self.start += 4 + len;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // A big frame does not leave its room behind for the life of the connection.
            if self.buf.len() > 4 * READ_CHUNK {
                self.buf = vec![0; READ_CHUNK];
            }
        }
        Some(m)
    }

    /// Room past `end` for the next read: at least what the frame in progress lacks (up to
    /// [`READ_CHUNK`] at a time), moving the bytes not taken to the front first if that makes room.
    fn make_room(&mut self) {
        let have = self.end - self.start;
        let need = self
            .next_len()
            .map_or(READ_CHUNK, |len| (4 + len - have).min(READ_CHUNK));
        if self.buf.len() - self.end >= need {
            return;
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.start = 0;
            self.end = have;
        }
        if self.buf.len() - self.end < need {
            self.buf.resize(self.end + need, 0);
        }
    }
}

impl<R: AsyncRead + Unpin, M: prost::Message + Default> tonic::codegen::tokio_stream::Stream
    for FrameReader<R, M>
{
    type Item = io::Result<M>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(frame) = this.take() {
                this.done = frame.is_err();
                return Poll::Ready(Some(frame));
            }
            this.make_room();
            let mut read = ReadBuf::new(&mut this.buf[this.end..]);
            match Pin::new(&mut this.io).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) => {
                    let n = read.filled().len();
                    if n == 0 {
                        this.done = true;
                        if this.end == this.start {
                            return Poll::Ready(None);
                        }
                        return Poll::Ready(Some(Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the connection closed inside a frame",
                        ))));
                    }
                    this.end += n;
                    if let Some(idle) = &mut this.idle {
                        idle.last_read = tokio::time::Instant::now();
                    }
                }
                Poll::Ready(Err(e)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Pending => {
                    let Some(idle) = &mut this.idle else {
                        return Poll::Pending;
                    };
                    // The timer is moved only when it fires: a read does not touch it.
                    loop {
                        if idle.timer.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        let due = idle.last_read + idle.after;
                        if due <= tokio::time::Instant::now() {
                            this.done = true;
                            return Poll::Ready(Some(Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("nothing read for {:?}", idle.after),
                            ))));
                        }
                        idle.timer.as_mut().reset(due);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tonic::codegen::tokio_stream::StreamExt;

    fn call(id: u64, value: usize) -> crate::v1::CallRequest {
        crate::v1::CallRequest {
            id,
            call: Some(crate::v1::call_request::Call::Acquire(
                crate::v1::AcquireRequest {
                    value: vec![7; value],
                    ..Default::default()
                },
            )),
        }
    }

    /// Frames come out whole and in order however the bytes are cut, one read may carry many, a
    /// frame bigger than a read is put together, and the stream ends cleanly between frames.
    #[tokio::test]
    async fn frames_come_out_whole_however_the_bytes_arrive() {
        let sent: Vec<_> = (0..50)
            .map(|i| call(i, [0, 10, 40_000, 3][i as usize % 4]))
            .collect();
        let mut bytes = Vec::new();
        for m in &sent {
            encode(m, &mut bytes);
        }
        for cut in [1, 3, 4096, 1 << 20] {
            let (mut w, r) = tokio::io::duplex(1 << 16);
            let chunks: Vec<Vec<u8>> = bytes.chunks(cut).map(|c| c.to_vec()).collect();
            let writer = tokio::spawn(async move {
                for c in chunks {
                    w.write_all(&c).await.unwrap();
                }
            });
            let got: Vec<_> = FrameReader::<_, crate::v1::CallRequest>::new(r, 64 << 10)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .map(|m| m.expect("a good frame"))
                .collect();
            writer.await.unwrap();
            assert_eq!(got, sent, "cut every {cut} bytes");
        }
    }

    /// A length over the limit is refused before its bytes are read; a close inside a frame is an
    /// error, not an end; and nothing read for the idle time is an error.
    #[tokio::test(start_paused = true)]
    async fn bad_lengths_truncation_and_silence_are_errors() {
        let (mut w, r) = tokio::io::duplex(1 << 16);
        w.write_all(&(1_000_001u32).to_le_bytes()).await.unwrap();
        let mut frames = FrameReader::<_, crate::v1::CallRequest>::new(r, 1_000_000);
        let e = frames.next().await.unwrap().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(frames.next().await.is_none(), "nothing after an error");

        let (mut w, r) = tokio::io::duplex(1 << 16);
        let mut bytes = Vec::new();
        encode(&call(1, 100), &mut bytes);
        w.write_all(&bytes[..bytes.len() - 1]).await.unwrap();
        drop(w);
        let mut frames = FrameReader::<_, crate::v1::CallRequest>::new(r, 1 << 20);
        let e = frames.next().await.unwrap().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");

        let (mut w, r) = tokio::io::duplex(1 << 16);
        let mut frames =
            FrameReader::<_, crate::v1::CallRequest>::new(r, 1 << 20).idle(Duration::from_secs(60));
        let started = tokio::time::Instant::now();
        // A frame at 40 s moves the deadline to 100 s.
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(40)).await;
            w.write_all(&bytes).await.unwrap();
            w
        });
        assert_eq!(frames.next().await.unwrap().unwrap().id, 1);
        let _w = writer.await.unwrap();
        let e = frames.next().await.unwrap().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert_eq!(started.elapsed(), Duration::from_secs(100));
    }
}
