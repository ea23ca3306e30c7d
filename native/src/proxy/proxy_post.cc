// Reading FIFO commands and posting them: what each command becomes on the transport (a write with immediate, a
// write plus a native atomic add, a bare immediate), under flow control. QUIET and BARRIER fence what follows them.
#include "proxy_impl.hpp"

namespace uccl_moe {

using detail::AtomicCounters;
using detail::Clock;

void Proxy::Impl::post_cmd(Thread& t, FifoState& fs, Entry& e) {
  const TransferCmdFields& f = e.f;
  const int dst = int(f.dst_rank);
  if (dst >= opt.num_ranks)
    UCCL_THROW(kTransport, "FIFO %d command %llu (%s): dst_rank %d >= num_ranks %d", fs.global_idx,
               (unsigned long long)e.idx, describe(f).c_str(), dst, opt.num_ranks);
  if (f.op == CmdOp::kWrite) {  // the common command: everything below is the ATOMIC's
    post_write_piece(t, fs, e);
    AtomicCounters::bump(t.stats.writes);
    AtomicCounters::bump(t.stats.bytes, f.bytes);
    return;
  }
  const bool ll = (f.flags & kCmdFlagLL) != 0;
  const bool phase = (f.flags & kCmdFlagPhase) != 0;
  WorkRequest wr;
  wr.wr_id = wr_id_of(fs, e.idx);
  wr.peer = dst;
  // ATOMIC. An LL fence counts its group's writes at the receiver: they may come from several FIFOs of the thread,
  // posted in any order between FIFOs, so no NIC atomic could follow them all. LL goes as a write with immediate also
  // with native atomics; native adds carry HT counters only, which follow their FIFO's writes on the same QP.
  if (software_atomics || ll) {
    wr.op = WrOp::kWriteImm;
    wr.bytes = 0;
    wr.imm = ll ? detail::encode_imm_ll(true, phase, f.counter_slot, f.bytes)
                : detail::encode_imm_ht(true, uint32_t(fs.channel), t.next_seq[seq_slot(t, dst, fs)]++, f.counter_slot,
                                        f.counter_value);
  } else {
    wr.op = WrOp::kAtomicAdd;
    wr.counter_index = counter_index_of(f);
    wr.add = int64_t(f.counter_value);
  }
  ++e.pending_wrs;
  t.ep->post(wr);
  AtomicCounters::bump(t.stats.atomics);
  t.flow->on_post(fs.channel, e.bytes);
  AtomicCounters::raise_to(t.stats.peak_inflight_bytes, uint64_t(t.flow->peak_bytes()));
}

// The next piece of WRITE `e`: at most the in-flight byte limit (FlowControl::piece_bytes), one piece in flight at a
// time, so a command larger than the limit never has more than the limit in flight. Only the last piece carries the
// counter update or the LL tag; earlier pieces are ordinary writes of the same FIFO (HT: each with its sequence
// number; LL on an ordered transport: plain writes that land before the last piece).
void Proxy::Impl::post_write_piece(Thread& t, FifoState& fs, Entry& e) {
  const TransferCmdFields& f = e.f;
  const int dst = int(f.dst_rank);
  const uint64_t piece = t.flow->piece_bytes(f.bytes - e.sent);
  const bool last = e.sent + piece == f.bytes;
  const bool ll = (f.flags & kCmdFlagLL) != 0;
  const bool phase = (f.flags & kCmdFlagPhase) != 0;
  const bool counter = last && (f.flags & kCmdFlagCounter) != 0;
  if (ll && !last && !caps.ordered)
    UCCL_THROW(kInvalidUsage, "FIFO %d command %llu (%s): an LL write larger than the in-flight byte limit (%lld) "
               "cannot be split on the unordered %s transport; raise UCCL_MOE_MAX_INFLIGHT_BYTES", fs.global_idx,
               (unsigned long long)e.idx, describe(f).c_str(), (long long)t.flow->max_inflight_bytes(),
               transport->name());
  WorkRequest wr;
  wr.wr_id = wr_id_of(fs, e.idx);
  wr.peer = dst;
  wr.local_offset = f.src_offset + e.sent;
  wr.remote_offset = f.dst_offset + e.sent;
  wr.bytes = uint32_t(piece);
  if ((software_atomics || ll) && (last || !ll)) {  // LL: with immediate in both modes (see post_cmd)
    const uint32_t seq = ll ? 0 : t.next_seq[seq_slot(t, dst, fs)]++;
    wr.op = WrOp::kWriteImm;
    wr.imm = ll ? detail::encode_imm_ll(false, phase, f.counter_slot, 0)
                : detail::encode_imm_ht(counter, uint32_t(fs.channel), seq, f.counter_slot, f.counter_value);
  } else {
    wr.op = WrOp::kWrite;
  }
  ++e.pending_wrs;
  t.ep->post(wr);
  if (!software_atomics && !ll && counter) {  // ordered transport: the add lands after the write
    WorkRequest a;
    a.wr_id = wr.wr_id;
    a.op = WrOp::kAtomicAdd;
    a.peer = dst;
    a.counter_index = counter_index_of(f);
    a.add = f.counter_value;
    ++e.pending_wrs;
    t.ep->post(a);
  }
  e.sent += piece;
  e.bytes = piece;
  t.flow->on_post(fs.channel, piece);
  AtomicCounters::raise_to(t.stats.peak_inflight_bytes, uint64_t(t.flow->peak_bytes()));
}

bool Proxy::Impl::post_new(Thread& t) {
  bool any = false;
  // One clock read per pass, not per command: `posted` only feeds the timeout (seconds).
  Clock::time_point now{};
  bool have_now = false;
  for (FifoState* fs : t.fifos) {
    for (int budget = detail::kPostBudgetPerFifo; budget > 0; --budget) {
      if (!fs->inflight.empty()) {
        // A WRITE larger than the byte limit: its next piece once the previous one completed and the bytes fit;
        // later commands of the FIFO wait behind it.
        Entry& last = fs->inflight.back();
        if (last.f.op == CmdOp::kWrite && last.sent < last.f.bytes) {
          if (last.pending_wrs > 0 || !t.flow->admit_piece(t.flow->piece_bytes(last.f.bytes - last.sent))) break;
          last.posted = Clock::now();
          post_write_piece(t, *fs, last);
          any = true;
          continue;
        }
        // A QUIET or BARRIER not yet retired fences everything after it.
        const CmdOp back = fs->inflight.back().f.op;
        if (back == CmdOp::kQuiet || back == CmdOp::kBarrier) break;
      }
      if (fs->cursor - fs->retired >= fs->fifo->capacity()) break;
      TransferCmd raw;
      if (!fs->fifo->poll(fs->cursor, &raw)) break;
      TransferCmdFields f = decode(raw);
      const bool data_op = f.op == CmdOp::kWrite || f.op == CmdOp::kAtomic;
      if (data_op) {
        // Window: the oldest incomplete command of the FIFO is the front of `inflight` (retire() ran first).
        const uint64_t oldest = fs->inflight.empty() ? fs->cursor : fs->retired;
        const uint64_t bytes = f.op == CmdOp::kWrite ? f.bytes : 0;
        if (!t.flow->admit(fs->channel, fs->cursor, oldest, bytes)) {
          AtomicCounters::bump(t.stats.stalls);
          break;
        }
        t.flow->note_window(fs->cursor - oldest + 1);
        AtomicCounters::raise_to(t.stats.peak_inflight_window, uint64_t(t.flow->peak_window()));
      } else if (f.op != CmdOp::kQuiet && f.op != CmdOp::kBarrier) {
        UCCL_THROW(kTransport, "FIFO %d command %llu has invalid op %d (word0=0x%016llx word1=0x%016llx)",
                   fs->global_idx, (unsigned long long)fs->cursor, int(f.op), (unsigned long long)raw.word0,
                   (unsigned long long)raw.word1);
      }
      Entry& e = fs->inflight.emplace_back();
      e.f = f;
      e.idx = fs->cursor;
      if (!have_now) {
        now = Clock::now();
        have_now = true;
      }
      e.posted = now;
      ++fs->cursor;
      if (data_op) post_cmd(t, *fs, e);
      any = true;
    }
  }
  return any;
}

}  // namespace uccl_moe
