//! Session secrets: 128 random bits that every request acting on a session must show (see
//! `Command::Authorized` in the lock table).
//!
//! A real server reads them from the OS RNG (`/dev/urandom`), so they cannot be predicted from anything
//! else a client sees. The deterministic simulation draws them from the host's seed instead, so that a
//! seed replays exactly; its secrets guard nothing.

/// Where a server's session secrets come from.
pub struct SecretSource {
    /// `/dev/urandom`, opened once (reads of 16 bytes from it never block or come back short).
    #[cfg(not(holdfast_sim))]
    urandom: std::sync::Mutex<std::fs::File>,
    #[cfg(holdfast_sim)]
    state: std::sync::Mutex<u64>,
}

impl SecretSource {
    #[cfg_attr(not(holdfast_sim), allow(unused_variables))]
    pub fn new(seed: u64) -> SecretSource {
        SecretSource {
            #[cfg(not(holdfast_sim))]
            urandom: std::sync::Mutex::new(
                std::fs::File::open("/dev/urandom")
                    .expect("the OS random number generator (/dev/urandom) must be readable"),
            ),
            #[cfg(holdfast_sim)]
            state: std::sync::Mutex::new(seed),
        }
    }

    /// A new secret, never 0 (0 means "no secret").
    pub fn next(&self) -> u128 {
        loop {
            let secret = self.draw();
            if secret != 0 {
                return secret;
            }
        }
    }

    #[cfg(not(holdfast_sim))]
    fn draw(&self) -> u128 {
        use std::io::Read;
        let mut buf = [0u8; 16];
        // /dev/urandom is the kernel's CSPRNG (the same as getrandom(2) once it is seeded, which it is
        // long before a server starts).
        self.urandom
            .lock()
            .expect("secret source lock")
            .read_exact(&mut buf)
            .expect("the OS random number generator (/dev/urandom) must be readable");
        u128::from_le_bytes(buf)
    }

    #[cfg(holdfast_sim)]
    fn draw(&self) -> u128 {
        let mut s = self.state.lock().expect("secret source lock");
        let mut next = || {
            *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        (u128::from(next()) << 64) | u128::from(next())
    }
}

#[cfg(all(test, not(holdfast_sim)))]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_not_zero_and_do_not_repeat() {
        let source = SecretSource::new(0);
        let drawn: std::collections::BTreeSet<u128> = (0..1000).map(|_| source.next()).collect();
        assert_eq!(drawn.len(), 1000);
        assert!(!drawn.contains(&0));
    }
}
