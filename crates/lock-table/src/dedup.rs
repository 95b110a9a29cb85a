//! [`Window`]: a session's request-id deduplication window, the outcomes of its last
//! [`DEDUP_WINDOW`](crate::limits::DEDUP_WINDOW) requests, oldest first.
//!
//! Kept in 16 bytes a request: the request id and the outcome packed in one word (a tag in the top
//! byte, a payload of up to 56 bits). Most outcomes pack: a grant's token, a queue position, a release.
//! Those that do not (a refusal naming the holder and its token, numbers of 56 bits or more) are kept
//! whole beside the slots, in a list that exists only while it has any. As `(RequestId, Outcome)` pairs
//! the window was 32 bytes a request: at 100,000 sessions of ten requests each, 16 MB more.
//!
//! Encoded (in snapshots) as it always was: the sequence of `(RequestId, Outcome)` pairs, oldest first.
//!
//! Invariant: no request id is in two slots; every slot tagged [`SPILLED`] has exactly one entry in
//! `spilled` with its request id, and `spilled` has no other entry.

use crate::command::Outcome;
use crate::types::{FencingToken, RequestId};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

#[derive(Clone, Debug, Default)]
pub(crate) struct Window {
    /// (request id, packed outcome), oldest first.
    slots: VecDeque<(u64, u64)>,
    /// The outcomes of the slots tagged [`SPILLED`], whole.
    #[allow(
        clippy::box_collection,
        reason = "8 bytes in every session instead of 24 for a list few sessions ever have"
    )]
    spilled: Option<Box<Vec<(RequestId, Outcome)>>>,
}

const PAYLOAD_BITS: u32 = 56;
const PAYLOAD: u64 = (1 << PAYLOAD_BITS) - 1;

const GRANTED: u64 = 1;
const QUEUED: u64 = 2;
const RELEASED: u64 = 3;
const CANCELLED: u64 = 4;
const ABANDONED: u64 = 5;
const SESSION_CLOSED: u64 = 6;
/// The outcome is in `spilled`.
const SPILLED: u64 = 0xff;

fn pack(outcome: &Outcome) -> Option<u64> {
    let (tag, payload) = match *outcome {
        Outcome::Granted { token } => (GRANTED, token.0),
        Outcome::Queued { position } => (QUEUED, u64::from(position)),
        Outcome::Released => (RELEASED, 0),
        Outcome::Cancelled => (CANCELLED, 0),
        Outcome::Abandoned => (ABANDONED, 0),
        Outcome::SessionClosed { released } => (SESSION_CLOSED, u64::from(released)),
        _ => return None,
    };
    (payload <= PAYLOAD).then_some(tag << PAYLOAD_BITS | payload)
}

/// The outcome `word` packs (not [`SPILLED`]).
fn unpack(word: u64) -> Outcome {
    let payload = word & PAYLOAD;
    // Payloads of u32 fields were packed from a u32.
    let small = || u32::try_from(payload).expect("packed from a u32");
    match word >> PAYLOAD_BITS {
        GRANTED => Outcome::Granted {
            token: FencingToken(payload),
        },
        QUEUED => Outcome::Queued { position: small() },
        RELEASED => Outcome::Released,
        CANCELLED => Outcome::Cancelled,
        ABANDONED => Outcome::Abandoned,
        SESSION_CLOSED => Outcome::SessionClosed { released: small() },
        tag => unreachable!("no packed outcome has tag {tag}"),
    }
}

impl Window {
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Room allocated, in requests.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.slots.capacity()
    }

    /// The outcome remembered for `request`.
    pub(crate) fn get(&self, request: RequestId) -> Option<Outcome> {
        let &(_, word) = self.slots.iter().find(|(r, _)| *r == request.0)?;
        Some(self.outcome(request, word))
    }

    fn outcome(&self, request: RequestId, word: u64) -> Outcome {
        if word >> PAYLOAD_BITS == SPILLED {
            let spilled = self
                .spilled
                .as_deref()
                .expect("a spilled slot has its outcome");
            let (_, outcome) = spilled
                .iter()
                .find(|(r, _)| *r == request)
                .expect("a spilled slot has its outcome");
            outcome.clone()
        } else {
            unpack(word)
        }
    }

    /// The requests and their outcomes, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (RequestId, Outcome)> + '_ {
        self.slots
            .iter()
            .map(|&(r, word)| (RequestId(r), self.outcome(RequestId(r), word)))
    }

    /// The largest request id remembered.
    pub(crate) fn highest(&self) -> Option<u64> {
        self.slots.iter().map(|(r, _)| *r).max()
    }

    /// Forgets the oldest request; returns its id.
    pub(crate) fn pop_front(&mut self) -> Option<RequestId> {
        let (r, word) = self.slots.pop_front()?;
        if word >> PAYLOAD_BITS == SPILLED {
            self.unspill(RequestId(r));
        }
        Some(RequestId(r))
    }

    /// Remembers `outcome` for `request` (not remembered yet), growing the room by one slot at a time:
    /// a session that made ten requests keeps room for ten, not the sixteen that doubling gives.
    pub(crate) fn push_back(&mut self, request: RequestId, outcome: &Outcome) {
        let word = self.spill_unless_packed(request, outcome);
        self.slots.reserve_exact(1);
        self.slots.push_back((request.0, word));
    }

    /// Replaces the outcome remembered for `request`, if it is remembered.
    pub(crate) fn update(&mut self, request: RequestId, outcome: &Outcome) {
        let Some(at) = self.slots.iter().position(|(r, _)| *r == request.0) else {
            return;
        };
        if self.slots[at].1 >> PAYLOAD_BITS == SPILLED {
            self.unspill(request);
        }
        self.slots[at].1 = self.spill_unless_packed(request, outcome);
    }

    fn spill_unless_packed(&mut self, request: RequestId, outcome: &Outcome) -> u64 {
        pack(outcome).unwrap_or_else(|| {
            self.spilled
                .get_or_insert_with(Default::default)
                .push((request, outcome.clone()));
            SPILLED << PAYLOAD_BITS
        })
    }

    fn unspill(&mut self, request: RequestId) {
        let spilled = self
            .spilled
            .as_mut()
            .expect("a spilled slot has its outcome");
        if let Some(at) = spilled.iter().position(|(r, _)| *r == request) {
            spilled.swap_remove(at);
        }
        if spilled.is_empty() {
            self.spilled = None;
        }
    }

    /// Checks the invariant (module docs); panics on a violation.
    pub(crate) fn check(&self) {
        let mut spilled: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, w)| w >> PAYLOAD_BITS == SPILLED)
            .map(|(r, _)| *r)
            .collect();
        let mut kept: Vec<u64> = self
            .spilled
            .as_deref()
            .map_or(Vec::new(), |s| s.iter().map(|(r, _)| r.0).collect());
        // In any order: an update spills again at the end.
        spilled.sort_unstable();
        kept.sort_unstable();
        assert_eq!(spilled, kept, "spilled slots and outcomes kept whole");
        assert!(self.spilled.as_ref().is_none_or(|s| !s.is_empty()));
        let mut ids: Vec<u64> = self.slots.iter().map(|(r, _)| *r).collect();
        ids.sort_unstable();
        assert!(
            ids.windows(2).all(|w| w[0] != w[1]),
            "a request remembered twice"
        );
    }
}

/// The same requests and outcomes in the same order (however the spilled ones are listed).
impl PartialEq for Window {
    fn eq(&self, other: &Window) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Window {}

impl FromIterator<(RequestId, Outcome)> for Window {
    fn from_iter<I: IntoIterator<Item = (RequestId, Outcome)>>(iter: I) -> Window {
        let mut w = Window::default();
        for (request, outcome) in iter {
            let word = w.spill_unless_packed(request, &outcome);
            w.slots.push_back((request.0, word));
        }
        w.slots.shrink_to_fit();
        w
    }
}

impl Serialize for Window {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for Window {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let pairs = Vec::<(RequestId, Outcome)>::deserialize(d)?;
        // The table never remembers a request twice (a retry is answered from the window), and
        // spilled outcomes are found by request id.
        let mut ids: Vec<u64> = pairs.iter().map(|(r, _)| r.0).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(serde::de::Error::custom(
                "a request id twice in a dedup window",
            ));
        }
        Ok(pairs.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Limit, Refusal};
    use crate::types::SessionId;

    fn outcomes() -> Vec<Outcome> {
        vec![
            Outcome::Granted {
                token: FencingToken(7),
            },
            Outcome::Granted {
                token: FencingToken(PAYLOAD),
            },
            Outcome::Granted {
                token: FencingToken(PAYLOAD + 1),
            },
            Outcome::Queued { position: u32::MAX },
            Outcome::Released,
            Outcome::Cancelled,
            Outcome::Abandoned,
            Outcome::SessionClosed { released: 3 },
            Outcome::Refused(Refusal::Held {
                holder: SessionId(9),
                token: FencingToken(u64::MAX),
            }),
            Outcome::Refused(Refusal::LimitExceeded(Limit::Locks)),
            Outcome::Refused(Refusal::NotHolder),
        ]
    }

    /// Every outcome reads back as it was pushed, through updates and evictions, and encodes as the
    /// pairs did.
    #[test]
    fn a_window_remembers_every_outcome_and_encodes_as_pairs() {
        let all = outcomes();
        let mut w = Window::default();
        let mut model: VecDeque<(RequestId, Outcome)> = VecDeque::new();
        for (i, o) in all.iter().cycle().take(60).enumerate() {
            let r = RequestId(i as u64 + 1);
            if w.len() >= 8 {
                assert_eq!(w.pop_front(), model.pop_front().map(|(r, _)| r));
            }
            w.push_back(r, o);
            model.push_back((r, o.clone()));
            // Every third, rewrite an older one with the outcome after it.
            if i % 3 == 0 {
                let at = i % model.len();
                let (old, _) = model[at];
                let next = all[(i + 1) % all.len()].clone();
                w.update(old, &next);
                model[at].1 = next;
            }
            w.check();
            assert_eq!(w.iter().collect::<VecDeque<_>>(), model);
            for (r, o) in &model {
                assert_eq!(w.get(*r).as_ref(), Some(o));
            }
            assert_eq!(
                postcard::to_allocvec(&w).unwrap(),
                postcard::to_allocvec(&model).unwrap()
            );
            let back: Window = postcard::from_bytes(&postcard::to_allocvec(&w).unwrap()).unwrap();
            back.check();
            assert_eq!(back, w);
        }
        assert_eq!(w.get(RequestId(1)), None);
        // Spilled outcomes do not outlive their slots.
        while w.pop_front().is_some() {}
        assert!(w.slots.is_empty() && w.spilled.is_none());
    }

    #[test]
    fn a_window_naming_a_request_twice_is_refused() {
        let pairs = vec![
            (RequestId(1), Outcome::Released),
            (RequestId(1), Outcome::Cancelled),
        ];
        let bytes = postcard::to_allocvec(&pairs).unwrap();
        assert!(postcard::from_bytes::<Window>(&bytes).is_err());
    }

    #[test]
    fn a_request_costs_16_bytes() {
        assert_eq!(std::mem::size_of::<(u64, u64)>(), 16);
        assert!(pack(&Outcome::Granted {
            token: FencingToken(1 << 40)
        })
        .is_some());
    }
}
