//! The frame format (little-endian), shared by every byte link:
//! request: `MLRQ step:u64 layer:u32 epoch:u64 npicks:u32 nacts:u32 [row:u32 expert:u32]* [f32]*`;
//! reply: `MLRP step:u64 layer:u32 epoch:u64 status:u8` then `n:u32 [f32]*` (status 0, ok)
//! or `fault:u8 n:u32 utf8` (status 2, an error and its [`Fault`]; status 1, an error without
//! one from an older sidecar, reads as Unavailable). Decoding checks every length against the frame: a bad frame is an
//! error, never a panic or an oversized allocation.

use moelane_engine::bank::Pick;
use moelane_engine::error::Fault;
use moelane_engine::tier::{ColdReply, ColdRequest};

const REQ: u32 = u32::from_le_bytes(*b"MLRQ");
const REP: u32 = u32::from_le_bytes(*b"MLRP");

/// Largest frame accepted (bytes).
pub const MAX_FRAME: usize = 1 << 30;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FrameError {
    #[error("bad frame: {0}")]
    Bad(String),
    #[error("sidecar error ({0:?}): {1}")]
    Remote(Fault, String),
}

pub fn encode_request(r: &ColdRequest, buf: &mut Vec<u8>) {
    buf.clear();
    buf.reserve(36 + r.picks.len() * 8 + r.activations.len() * 4);
    buf.extend_from_slice(&REQ.to_le_bytes());
    buf.extend_from_slice(&r.step.to_le_bytes());
    buf.extend_from_slice(&r.layer.to_le_bytes());
    buf.extend_from_slice(&r.epoch.to_le_bytes());
    buf.extend_from_slice(&(r.picks.len() as u32).to_le_bytes());
    buf.extend_from_slice(&(r.activations.len() as u32).to_le_bytes());
    for p in &r.picks {
        buf.extend_from_slice(&p.row.to_le_bytes());
        buf.extend_from_slice(&(p.expert as u32).to_le_bytes());
    }
    for x in &r.activations {
        buf.extend_from_slice(&x.to_le_bytes());
    }
}

pub fn encode_reply(
    r: &Result<ColdReply, moelane_engine::Error>,
    step: u64,
    layer: u32,
    epoch: u64,
    buf: &mut Vec<u8>,
) {
    buf.clear();
    buf.extend_from_slice(&REP.to_le_bytes());
    buf.extend_from_slice(&step.to_le_bytes());
    buf.extend_from_slice(&layer.to_le_bytes());
    buf.extend_from_slice(&epoch.to_le_bytes());
    match r {
        Ok(rep) => {
            buf.push(0);
            buf.extend_from_slice(&(rep.outputs.len() as u32).to_le_bytes());
            for x in &rep.outputs {
                buf.extend_from_slice(&x.to_le_bytes());
            }
        }
        Err(e) => {
            let text = e.to_string();
            buf.push(2);
            buf.push(e.fault().code());
            buf.extend_from_slice(&(text.len() as u32).to_le_bytes());
            buf.extend_from_slice(text.as_bytes());
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.b.len() - self.i < n {
            return Err(FrameError::Bad(format!(
                "truncated: needs {} more bytes at offset {}, frame has {}",
                n,
                self.i,
                self.b.len()
            )));
        }
        let s = &self.b[self.i..self.i + n];
        self.i += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn f32s(&mut self, n: usize, out: &mut Vec<f32>) -> Result<(), FrameError> {
        let s = self.take(
            n.checked_mul(4)
                .ok_or_else(|| FrameError::Bad("length overflow".into()))?,
        )?;
        out.clear();
        out.extend(
            s.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        Ok(())
    }
}

pub fn decode_request(b: &[u8], r: &mut ColdRequest) -> Result<(), FrameError> {
    let mut rd = Reader { b, i: 0 };
    if rd.u32()? != REQ {
        return Err(FrameError::Bad("not a request frame".into()));
    }
    r.step = rd.u64()?;
    r.layer = rd.u32()?;
    r.epoch = rd.u64()?;
    let np = rd.u32()? as usize;
    let na = rd.u32()? as usize;
    if np.saturating_mul(8).saturating_add(na.saturating_mul(4)) > b.len() {
        return Err(FrameError::Bad(format!(
            "{np} picks and {na} activations do not fit a {}-byte frame",
            b.len()
        )));
    }
    r.picks.clear();
    for _ in 0..np {
        let row = rd.u32()?;
        let e = rd.u32()?;
        let expert =
            u16::try_from(e).map_err(|_| FrameError::Bad(format!("expert id {e} out of range")))?;
        r.picks.push(Pick { row, expert });
    }
    rd.f32s(na, &mut r.activations)?;
    if rd.i != b.len() {
        return Err(FrameError::Bad(format!(
            "{} trailing bytes",
            b.len() - rd.i
        )));
    }
    Ok(())
}

pub fn decode_reply(b: &[u8], r: &mut ColdReply) -> Result<(), FrameError> {
    let mut rd = Reader { b, i: 0 };
    if rd.u32()? != REP {
        return Err(FrameError::Bad("not a reply frame".into()));
    }
    r.step = rd.u64()?;
    r.layer = rd.u32()?;
    r.epoch = rd.u64()?;
    let status = rd.take(1)?[0];
    let fault = match status {
        2 => Fault::from_code(rd.take(1)?[0]),
        _ => Fault::Unavailable,
    };
    let n = rd.u32()? as usize;
    match status {
        0 => rd.f32s(n, &mut r.outputs)?,
        1 | 2 => {
            return Err(FrameError::Remote(
                fault,
                String::from_utf8_lossy(rd.take(n)?).into_owned(),
            ))
        }
        s => return Err(FrameError::Bad(format!("unknown status {s}"))),
    }
    if rd.i != b.len() {
        return Err(FrameError::Bad(format!(
            "{} trailing bytes",
            b.len() - rd.i
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_truncation_is_an_error() {
        let req = ColdRequest {
            step: 9,
            layer: 3,
            epoch: 2,
            picks: vec![
                Pick { row: 0, expert: 5 },
                Pick {
                    row: 1,
                    expert: 383,
                },
            ],
            activations: vec![1.0, -2.5, 3.25, 0.0],
        };
        let mut buf = Vec::new();
        encode_request(&req, &mut buf);
        let mut got = ColdRequest::default();
        decode_request(&buf, &mut got).unwrap();
        assert_eq!(got, req);
        for cut in 0..buf.len() {
            assert!(decode_request(&buf[..cut], &mut got).is_err());
        }
        // seeded garbage never panics
        let mut x: u32 = 7;
        for _ in 0..5000 {
            let mut g = buf.clone();
            for _ in 0..3 {
                x = x.wrapping_mul(1664525).wrapping_add(1013904223);
                let i = (x as usize) % g.len();
                g[i] = (x >> 24) as u8;
            }
            let _ = decode_request(&g, &mut got);
            let _ = decode_reply(&g, &mut ColdReply::default());
        }
        let rep = ColdReply {
            step: 9,
            layer: 3,
            epoch: 2,
            outputs: vec![0.5; 8],
        };
        encode_reply(&Ok(rep.clone()), 9, 3, 2, &mut buf);
        let mut r = ColdReply::default();
        decode_reply(&buf, &mut r).unwrap();
        assert_eq!(r, rep);
        let e = moelane_engine::Error::NotResident {
            layer: 3,
            expert: 7,
            tier: "cold",
        };
        encode_reply(&Err(e), 9, 3, 2, &mut buf);
        // the fault travels with the text: the primary matches on it, not on the words
        match decode_reply(&buf, &mut r) {
            Err(FrameError::Remote(Fault::NotResident, t)) => assert!(t.contains("expert 7")),
            other => panic!("{other:?}"),
        }
        // an older sidecar's error (status 1, no fault byte) reads as Unavailable
        let mut old = buf[..24].to_vec();
        old.push(1);
        old.extend_from_slice(&3u32.to_le_bytes());
        old.extend_from_slice(b"old");
        match decode_reply(&old, &mut r) {
            Err(FrameError::Remote(Fault::Unavailable, t)) => assert_eq!(t, "old"),
            other => panic!("{other:?}"),
        }
    }
}
