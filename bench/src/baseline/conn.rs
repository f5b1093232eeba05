//! The baseline's socket, blocking or spinning: `read_exact` and
//! `write_all` either sleep in the kernel or retry a non-blocking call in a
//! tight loop until it makes progress (yielding the CPU between tries when
//! the thread shares its CPU with other spinners, see [`Conn::yielding`]).

use std::io::{self, Read, Write};
use std::net::TcpStream;

/// A connected TCP stream with `TCP_NODELAY`, in one of the two modes.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    spin: bool,
    /// Spinning: yield the CPU between tries instead of a pause.
    yield_cpu: bool,
}

impl Conn {
    /// Sets `TCP_NODELAY`, and `O_NONBLOCK` when `spin` (the same as passing
    /// `MSG_DONTWAIT` to every call).
    pub fn new(stream: TcpStream, spin: bool) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(spin)?;
        Ok(Self {
            stream,
            spin,
            yield_cpu: false,
        })
    }

    /// The same connection, spinning with a `sched_yield` between tries:
    /// for threads that spin on a CPU they share with other spinners, which
    /// would otherwise wait a whole time slice for each other (what the
    /// local page-servers do, see page-server's `read_spinning`).
    pub fn yielding(mut self) -> Self {
        self.yield_cpu = true;
        self
    }

    /// Between two tries of a spinning call.
    fn pause(&self) {
        if self.yield_cpu {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }

    /// Fills `buf`; `UnexpectedEof` when the peer closes first.
    pub fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        if !self.spin {
            return self.stream.read_exact(buf);
        }
        let mut got = 0;
        while got < buf.len() {
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if retry(&e) => self.pause(),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads what has arrived into `buf` (at least one byte; blocking or
    /// spinning until then); `UnexpectedEof` when the peer closed.
    pub fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.stream.read(buf) {
                Ok(0) if !buf.is_empty() => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => return Ok(n),
                Err(e) if retry(&e) => self.pause(),
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends all of `buf`.
    pub fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        if !self.spin {
            return self.stream.write_all(buf);
        }
        let mut sent = 0;
        while sent < buf.len() {
            match self.stream.write(&buf[sent..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => sent += n,
                Err(e) if retry(&e) => self.pause(),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn spinning_round_trip_and_eof() -> io::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let echo = std::thread::spawn(move || -> io::Result<()> {
            let mut c = Conn::new(listener.accept()?.0, true)?;
            let mut buf = vec![0u8; 100_000];
            c.read_exact(&mut buf)?;
            c.write_all(&buf)
        });
        let mut c = Conn::new(TcpStream::connect(addr)?, true)?;
        let out: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        c.write_all(&out)?;
        let mut back = vec![0u8; out.len()];
        c.read_exact(&mut back)?;
        assert_eq!(back, out);
        echo.join()
            .map_err(|_| io::Error::other("echo panicked"))??;
        let mut one = [0u8; 1];
        let err = c.read_exact(&mut one).err().map(|e| e.kind());
        assert_eq!(err, Some(io::ErrorKind::UnexpectedEof));
        Ok(())
    }
}
