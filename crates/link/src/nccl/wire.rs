//! The NCCL link's messages: a request's preamble (frame and reply lengths, activation
//! count), the request frame inline in the first 64 KiB message when it fits, and the reply
//! head (status, tags, payload length, the error's fault) before the outputs or the error's
//! text. Every length read is checked against the message before it is used.

use super::*;

/// Bytes of a request's first message, always: a small request (preamble, frame and
/// activations within it) travels whole in one NCCL call; a larger one sends its preamble in
/// it and the frame and the activations as two more messages.
pub const SLOT: usize = 64 << 10;

/// Where a request's activations start inside its first message, when they fit there:
/// after the preamble and the frame, 16-byte aligned.
pub fn inline_offset(frame_len: usize, acts: usize) -> Option<usize> {
    let off = (PREAMBLE + frame_len).div_ceil(16) * 16;
    (off + 4 * acts <= SLOT).then_some(off)
}

/// The reply length a primary expects for `picks` output rows of `hidden` floats.
pub fn reply_len(picks: usize, hidden: usize) -> usize {
    REPLY_HEAD + (4 * picks * hidden).max(ERR_ROOM)
}

/// Encodes a preamble.
pub fn preamble(frame_len: usize, reply_len: usize, acts: usize) -> [u8; PREAMBLE] {
    let mut p = [0u8; PREAMBLE];
    p[..4].copy_from_slice(&MAGIC.to_le_bytes());
    p[4..8].copy_from_slice(&VERSION.to_le_bytes());
    p[8..12].copy_from_slice(&(frame_len as u32).to_le_bytes());
    p[12..16].copy_from_slice(&(reply_len as u32).to_le_bytes());
    p[16..20].copy_from_slice(&(acts as u32).to_le_bytes());
    p
}

/// Checks the magic and version words that open a preamble or the handshake.
pub(super) fn check_hello(what: &str, b: &[u8]) -> Result<()> {
    let w = |i: usize| {
        b.get(i..i + 4)
            .map(|x| u32::from_le_bytes([x[0], x[1], x[2], x[3]]))
    };
    if w(0) != Some(MAGIC) {
        return Err(err(format!(
            "{what}: the peer is not a moelane NCCL link (bad magic)"
        )));
    }
    match w(4) {
        Some(VERSION) => Ok(()),
        v => Err(err(format!(
            "{what}: the peer speaks NCCL link version {}, this side {VERSION}",
            v.unwrap_or(0)
        ))),
    }
}

/// Decodes a preamble: (frame_len, reply_len, activation floats), each checked against the
/// frame limit.
pub fn parse_preamble(b: &[u8]) -> Result<(usize, usize, usize)> {
    if b.len() != PREAMBLE {
        return Err(err(format!(
            "preamble of {} bytes, expected {PREAMBLE}",
            b.len()
        )));
    }
    check_hello("preamble", b)?;
    let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]) as usize;
    let (f, r, a) = (w(8), w(12), w(16));
    if f == 0 || f > MAX_FRAME {
        return Err(err(format!("request frame of {f} bytes")));
    }
    if !(REPLY_HEAD + ERR_ROOM..=MAX_FRAME).contains(&r) {
        return Err(err(format!("reply length {r} out of range")));
    }
    if a > MAX_FRAME / 4 {
        return Err(err(format!("{a} activation floats")));
    }
    Ok((f, r, a))
}

/// A reply's head: status 0 with `len` bytes of outputs after it, or 1 with an error text.
/// An error's [`Fault`] travels in byte 40 (0 from an older sidecar: Unavailable).
pub(super) fn reply_head(
    ok: bool,
    step: u64,
    layer: u32,
    epoch: u64,
    len: usize,
) -> [u8; REPLY_HEAD] {
    reply_head_fault(ok, None, step, layer, epoch, len)
}

pub(super) fn reply_head_fault(
    ok: bool,
    fault: Option<Fault>,
    step: u64,
    layer: u32,
    epoch: u64,
    len: usize,
) -> [u8; REPLY_HEAD] {
    let mut h = [0u8; REPLY_HEAD];
    h[..4].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&(!ok as u32).to_le_bytes());
    h[40] = fault.map_or(0, Fault::code);
    h[8..16].copy_from_slice(&step.to_le_bytes());
    h[16..20].copy_from_slice(&layer.to_le_bytes());
    h[24..32].copy_from_slice(&epoch.to_le_bytes());
    h[32..40].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// Writes a whole reply message of exactly `reply_len` bytes into `out`: the head, the
/// outputs (or the error's text, cut to fit), zeros. Outputs that do not fit become an
/// error that does.
pub fn pack_reply(
    rep: &Result<&[f32]>,
    reply_len: usize,
    step: u64,
    layer: u32,
    epoch: u64,
    out: &mut Vec<u8>,
) {
    out.clear();
    let room = reply_len.saturating_sub(REPLY_HEAD);
    match rep {
        Ok(v) if 4 * v.len() <= room => {
            out.extend_from_slice(&reply_head(true, step, layer, epoch, 4 * v.len()));
            for x in v.iter() {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        r => {
            let (mut text, fault) = match r {
                Ok(v) => (
                    format!(
                        "reply of {} bytes exceeds the {room} the primary expects",
                        4 * v.len()
                    ),
                    Fault::Internal,
                ),
                Err(e) => (e.to_string(), e.fault()),
            };
            while text.len() > room {
                text.pop();
            }
            let head = reply_head_fault(false, Some(fault), step, layer, epoch, text.len());
            out.extend_from_slice(&head);
            out.extend_from_slice(text.as_bytes());
        }
    }
    out.resize(reply_len.max(REPLY_HEAD), 0);
}

/// A reply's head: (ok, its tags with no outputs, payload bytes), checked against a message
/// of `msg_len` bytes.
pub(super) fn parse_head(b: &[u8], msg_len: usize) -> Result<(Option<Fault>, ColdReply, usize)> {
    if b.len() < REPLY_HEAD || msg_len < REPLY_HEAD {
        return Err(err(format!(
            "reply of {} bytes, shorter than its head",
            b.len()
        )));
    }
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u64_at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(a)
    };
    if u32_at(0) != REPLY_MAGIC {
        return Err(err("not a reply (bad magic)"));
    }
    let len = u64_at(32);
    if len > (msg_len - REPLY_HEAD) as u64 {
        return Err(err(format!(
            "reply payload of {len} bytes in a {msg_len}-byte message"
        )));
    }
    let failed = match u32_at(4) {
        0 if len % 4 == 0 => None,
        0 => return Err(err(format!("reply payload of {len} bytes is not floats"))),
        1 => Some(Fault::from_code(b[40])),
        s => return Err(err(format!("reply status {s}"))),
    };
    let tags = ColdReply {
        step: u64_at(8),
        layer: u32_at(16),
        epoch: u64_at(24),
        outputs: Vec::new(),
    };
    Ok((failed, tags, len as usize))
}

pub(super) fn sidecar_error(fault: Fault, text: &[u8]) -> Error {
    Error::link(
        "nccl",
        fault,
        format!("the sidecar answered: {}", String::from_utf8_lossy(text)),
    )
}

/// Reads a reply message (see [`pack_reply`]).
pub fn unpack_reply(b: &[u8]) -> Result<ColdReply> {
    let (failed, mut rep, len) = parse_head(b, b.len())?;
    let payload = &b[REPLY_HEAD..REPLY_HEAD + len];
    if let Some(fault) = failed {
        return Err(sidecar_error(fault, payload));
    }
    rep.outputs = payload
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(rep)
}
