// The compacted row layout of the staged combine and the ring-free dispatch (nvl_layout.hpp: OwnBlock, buffer_rows,
// our_rows_at, staged_to_received, DirectLanding), against rows laid out one by one: for every pair of ranks, the
// row where the pull looks for our copy at rank d (or where our direct dispatch lands it) is the row that d's stage
// kernel filled with it (that d's unpack takes it from), for random counts with zeros (ranks that receive nothing,
// empty own blocks), N = 1..8. Also the copy-engine combine's landing areas and chunks (ce_block_at, ce_chunk_end)
// and the dispatch's kept-row split (kept_split).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "kernels/intranode/nvl_layout.hpp"

namespace uccl_moe::intranode {
namespace {

struct Counts {
  int n;
  std::vector<int32_t> count;   // [src][dst]: rows src sends dst
  std::vector<int32_t> prefix;  // [src][dst]: inclusive prefix over src (the handle's rank_prefix_matrix)
};

Counts random_counts(int n, std::mt19937* gen) {
  Counts c{n, std::vector<int32_t>(n * n), std::vector<int32_t>(n * n)};
  std::uniform_int_distribution<int> rows(0, 9), zero(0, 3);
  for (int i = 0; i < n * n; ++i) c.count[i] = zero(*gen) == 0 ? 0 : rows(*gen);
  for (int d = 0; d < n; ++d)
    for (int s = 0; s < n; ++s) c.prefix[s * n + d] = c.count[s * n + d] + (s > 0 ? c.prefix[(s - 1) * n + d] : 0);
  return c;
}

TEST(StagedLayout, PullFindsTheRowTheStageWrote) {
  std::mt19937 gen(20261126);
  for (int n = 1; n <= 8; ++n) {
    for (int trial = 0; trial < 300; ++trial) {
      const Counts c = random_counts(n, &gen);
      for (int d = 0; d < n; ++d) {
        // Rank d's received rows in order (source, index), and the compacted order without d's own.
        std::vector<std::pair<int, int>> received, compact;
        for (int s = 0; s < n; ++s)
          for (int j = 0; j < c.count[s * n + d]; ++j) {
            received.emplace_back(s, j);
            if (s != d) compact.emplace_back(s, j);
          }
        ASSERT_EQ(buffer_rows(c.prefix.data(), n, d, false), static_cast<int64_t>(received.size()));
        ASSERT_EQ(buffer_rows(c.prefix.data(), n, d, true), static_cast<int64_t>(compact.size()));
        const OwnBlock own(c.prefix.data(), n, d);
        // Our own copies (me == d): the start of d's own block, compacted or not (the pull reads them from x).
        ASSERT_EQ(our_rows_at(c.prefix.data(), n, d, d, true), own.begin);
        ASSERT_EQ(our_rows_at(c.prefix.data(), n, d, d, false), own.begin);
        // The stage kernel fills compacted row p from received row staged_to_received(p, ...).
        for (size_t p = 0; p < compact.size(); ++p)
          ASSERT_EQ(received[staged_to_received(p, own.begin, own.count)], compact[p]) << "n=" << n << " d=" << d;
        for (int me = 0; me < n; ++me) {
          if (me == d) continue;
          for (int j = 0; j < c.count[me * n + d]; ++j) {
            const int64_t at = our_rows_at(c.prefix.data(), n, me, d, true) + j;
            ASSERT_LT(at, static_cast<int64_t>(compact.size()));
            ASSERT_EQ(compact[at], std::make_pair(me, j)) << "n=" << n << " me=" << me << " d=" << d;
            const int64_t full = our_rows_at(c.prefix.data(), n, me, d, false) + j;
            ASSERT_EQ(received[full], std::make_pair(me, j));
          }
        }
      }
    }
  }
}

TEST(StagedLayout, UnitsScaleTheSameMap) {
  // The kernels apply the map to 16-byte words and to top-k weights: rows [0, 2) stay, rows from 2 skip 3.
  for (int64_t unit : {1, 4, 896}) {
    EXPECT_EQ(staged_to_received(2 * unit - 1, 2 * unit, 3 * unit), 2 * unit - 1);  // last unit of row 1
    EXPECT_EQ(staged_to_received(2 * unit, 2 * unit, 3 * unit), 5 * unit);          // row 2 is received row 5
  }
}

TEST(DirectLanding, FieldsFollowTheRowsOnAlignedLinesWithoutOverlap) {
  for (int64_t rows : {0, 1, 7, 4091}) {
    for (int row_bytes : {16, 7168, 14336}) {
      for (int k : {0, 1, 8}) {
        for (int s : {0, 56}) {
          const DirectLanding d = DirectLanding::make(rows, row_bytes, k, s);
          const int64_t starts[] = {d.src_off, d.topk_off, d.weights_off, d.scales_off};
          const int64_t sizes[] = {rows * 4, rows * k * 4, rows * k * 4, rows * s * 4};
          int64_t at = static_cast<int64_t>(kOffCombineInput) + rows * row_bytes;  // the rows come first
          for (int f = 0; f < 4; ++f) {
            EXPECT_EQ(starts[f] % 128, 0);
            EXPECT_GE(starts[f], at);
            EXPECT_LT(starts[f], at + 128);
            at = starts[f] + sizes[f];
          }
          EXPECT_EQ(d.end, at);
          EXPECT_EQ(d.rows, rows);
        }
      }
    }
  }
}

TEST(CeLanding, EverySendersBlockLandsWhereTheReceiverSumsIt) {
  // Rank d's landing area, laid out row by row: for each peer p != d in rank order, the rows d sent to p. Sender p
  // copies its block of x from source d (rows [prefix[d - 1][p], prefix[d][p])) to ce_block_at(d, p); the receiver
  // d reads its copy at p as ce_block_at(d, p) + its position among the rows it sent p. Every row lands once, inside
  // the area, and the area is exactly ce_landing_rows long.
  std::mt19937 gen(20261126);
  for (int n = 1; n <= 8; ++n) {
    for (int trial = 0; trial < 300; ++trial) {
      const Counts c = random_counts(n, &gen);
      for (int d = 0; d < n; ++d) {
        std::vector<int> owner;  // [landing row]: the peer whose copy lands there
        for (int p = 0; p < n; ++p)
          if (p != d)
            for (int i = 0; i < c.count[d * n + p]; ++i) owner.push_back(p);
        ASSERT_EQ(ce_landing_rows(c.prefix.data(), n, d), static_cast<int64_t>(owner.size()));
        for (int p = 0; p < n; ++p) {
          const int64_t rows = rows_sent(c.prefix.data(), n, d, p);
          ASSERT_EQ(rows, c.count[d * n + p]);
          if (p == d) continue;
          // what p's x holds of d's rows: its receive block from source d
          const int64_t first = d > 0 ? c.prefix[(d - 1) * n + p] : 0;
          ASSERT_EQ(c.prefix[d * n + p] - first, rows);
          const int64_t at = ce_block_at(c.prefix.data(), n, d, p);
          for (int64_t q = 0; q < rows; ++q) ASSERT_EQ(owner[at + q], p) << n << " " << d << " " << p << " " << q;
        }
      }
    }
  }
}

TEST(CeChunks, ChunksCoverTheBlockInOrderAndShrinkTowardTheEnd) {
  const auto ce_chunk_of = [](int64_t q, int64_t rows, int chunks, int shrink) {  // searched from the first chunk
    int64_t end = -1;
    return ce_chunk_from(q, rows, chunks, shrink, 0, &end);
  };
  for (int shrink : {kCeCombineShrinkPct, kCeDispatchShrinkPct, kCeDispatchScaledShrinkPct, 20, 75, 100}) {
    for (int chunks = 1; chunks <= kMaxCeChunks; ++chunks) {
      for (int64_t rows : {0, 1, 2, 3, 7, 100, 2047, 4096, 4093, 1 << 30}) {
        int64_t prev = 0, prev_len = rows + 1;
        for (int k = 0; k < chunks; ++k) {
          const int64_t end = ce_chunk_end(rows, k, chunks, shrink);
          ASSERT_LE(prev, end) << shrink << " " << chunks << " " << rows << " " << k;  // in order, maybe empty
          // no chunk before the last outgrows the one before it (by more than a rounded-down end, for shares)
          if (k < chunks - 1 && rows >= (int64_t{1} << chunks))
            ASSERT_LE(end - prev, prev_len + (shrink > 0 ? 1 : 0))
                << shrink << " " << chunks << " " << rows << " " << k;
          if (rows < 5000)
            for (int64_t q = prev; q < end; ++q) {
              ASSERT_EQ(ce_chunk_of(q, rows, chunks, shrink), k) << rows << " " << q;
              // a reader that knows chunks [0, k0) landed searches from k0 and learns where q's chunk ends
              for (int k0 = 0; k0 <= k; ++k0) {
                int64_t got_end = -1;
                ASSERT_EQ(ce_chunk_from(q, rows, chunks, shrink, k0, &got_end), k) << rows << " " << q << " " << k0;
                ASSERT_EQ(got_end, end) << rows << " " << q << " " << k0;
              }
            }
          prev_len = end - prev;
          prev = end;
        }
        ASSERT_EQ(prev, rows);  // the last chunk ends the block
      }
    }
  }
  EXPECT_EQ(ce_chunk_end(4096, 0, 4, 0), 2048);  // halves, then quarters, then eighths, then the rest
  EXPECT_EQ(ce_chunk_end(4096, 1, 4, 0), 3072);
  EXPECT_EQ(ce_chunk_end(4096, 2, 4, 0), 3584);
  EXPECT_EQ(ce_chunk_end(4096, 3, 4, 0), 4096);
  EXPECT_EQ(ce_chunk_of(4095, 4096, 4, 0), 3);
  // 40%: weights 1, 0.4, 0.16 of 1.56: 2625.6, then 3675.9 rounded down
  EXPECT_EQ(ce_chunk_end(4096, 0, 3, 40), 2625);
  EXPECT_EQ(ce_chunk_end(4096, 1, 3, 40), 3675);
  EXPECT_EQ(ce_chunk_end(4096, 2, 3, 40), 4096);
  EXPECT_EQ(ce_chunk_of(3675, 4096, 3, 40), 2);
  EXPECT_EQ(ce_chunk_end(4096, 0, 2, 100), 2048);  // equal shares
  // 50%: 1, 0.5, 0.25 of 1.75
  EXPECT_EQ(ce_chunk_end(4096, 0, 3, 50), 2340);
  EXPECT_EQ(ce_chunk_end(4096, 1, 3, 50), 3510);
  // the dispatch's pick: steeper shares for rows without scales (BF16), 35% with scales (FP8)
  EXPECT_EQ(ce_dispatch_shrink_pct(0), 25);
  // 25%: 1, 0.25, 0.0625 of 1.3125: 3120.8, then 3900.9 rounded down (the last chunk 195 rows)
  EXPECT_EQ(ce_chunk_end(4096, 0, 3, 25), 3120);
  EXPECT_EQ(ce_chunk_end(4096, 1, 3, 25), 3900);
  EXPECT_EQ(ce_dispatch_shrink_pct(56), 35);
  EXPECT_EQ(ce_dispatch_shrink_pct(1), 35);
  // 35%: 1, 0.35, 0.1225 of 1.4725: 2781.7, then 3755.2 rounded down (the last chunk 341 rows)
  EXPECT_EQ(ce_chunk_end(4096, 0, 3, 35), 2781);
  EXPECT_EQ(ce_chunk_end(4096, 1, 3, 35), 3755);
}

TEST(CeChunks, TheKernelStoresTheFirstRowsOfABlockWithoutScales) {
  // kCeSmHeadBytes of whole rows over the peers' blocks, never more than a block, none where the head holds scales
  EXPECT_EQ(ce_head_rows(4096, 14336, false, 1), (int64_t{4} << 20) / 14336);
  EXPECT_EQ(ce_head_rows(4096, 14336, false, 3), (int64_t{4} << 20) / 3 / 14336);
  EXPECT_EQ(ce_head_rows(4096, 14336, false, 0), 0);  // EP1: no peer
  EXPECT_EQ(ce_head_rows(4096, 14336, true, 1), 0);
  EXPECT_EQ(ce_head_rows(100, 14336, false, 1), 100);
  EXPECT_EQ(ce_head_rows(0, 14336, false, 1), 0);
  EXPECT_EQ(ce_head_rows(4096, 7168, false, 1), 585);
  EXPECT_EQ(ce_head_rows(4096, int64_t{8} << 20, false, 1), 0);  // a row longer than the head: the engines copy it
  for (int peers = 1; peers <= 7; ++peers)
    for (int64_t rows : {0, 1, 7, 292, 293, 4096}) {
      const int64_t head = ce_head_rows(rows, 14336, false, peers);
      ASSERT_LE(head * 14336 * peers, kCeSmHeadBytes);
      ASSERT_LE(head, rows);
    }
}

TEST(CeDispatchLanding, EverySourcesTokensAndScalesGetTheirOwnLines) {
  // Rank d's landing area: each other source's whole x, then its scales, in rank order, each piece on a 128-B line
  // from kOffCombineInput, none overlapping; d's own entries are -1; the end covers the last piece.
  std::mt19937 gen(20261127);
  std::uniform_int_distribution<int> tokens_of(0, 5000), scales_of(0, 60);
  for (int n = 1; n <= 8; ++n) {
    for (int trial = 0; trial < 200; ++trial) {
      int32_t tokens[kMaxLocalRanks];
      for (int s = 0; s < n; ++s) tokens[s] = trial % 5 == 0 ? 0 : tokens_of(gen);
      const int64_t row_bytes = 16 * (1 + trial % 900);
      const int S = scales_of(gen);
      for (int d = 0; d < n; ++d) {
        int64_t rows_at[kMaxLocalRanks], scales_at[kMaxLocalRanks];
        const int64_t end = ce_dispatch_landing(tokens, n, d, row_bytes, S, rows_at, scales_at);
        int64_t at = static_cast<int64_t>(kOffCombineInput);
        for (int s = 0; s < n; ++s) {
          if (s == d) {
            ASSERT_EQ(rows_at[s], -1);
            ASSERT_EQ(scales_at[s], -1);
            continue;
          }
          ASSERT_EQ(rows_at[s] % 128, 0);
          ASSERT_GE(rows_at[s], at);
          ASSERT_GE(scales_at[s], rows_at[s] + tokens[s] * row_bytes);
          ASSERT_EQ(scales_at[s] % 128, 0);
          at = scales_at[s] + int64_t{tokens[s]} * S * 4;
        }
        ASSERT_GE(end, at);
        ASSERT_LT(end - at, 128);
      }
    }
  }
}

TEST(KeptSplit, SplitsEveryLaneWithinItsRangeByRowSize) {
  for (int begin : {0, 1, 7, 4096}) {
    int prev = begin;
    for (int len = 0; len <= 400; ++len) {
      const int end = begin + len;
      const int bf16 = kept_split(begin, end, 14336), fp8 = kept_split(begin, end, 7168);
      ASSERT_EQ(bf16 - begin, (len + 3) / 4) << len;      // a quarter, rounded up
      ASSERT_EQ(fp8 - begin, (3 * len + 7) / 8) << len;   // three eighths, rounded up
      ASSERT_LE(begin, fp8) << len;
      ASSERT_LE(fp8, end) << len;
      ASSERT_LE(bf16, fp8) << len;                         // FP8-sized rows give the direct warp no less
      ASSERT_LE(prev, fp8) << len;                         // grows with the lane
      prev = fp8;
    }
    EXPECT_EQ(kept_split(begin, begin, 8192), begin);  // an empty lane, and 8 KB rows take the FP8 share
    EXPECT_EQ(kept_split(begin, begin + 8, 8192) - begin, 3);
    EXPECT_EQ(kept_split(begin, begin + 8, 8208) - begin, 2);
  }
}

}  // namespace
}  // namespace uccl_moe::intranode
