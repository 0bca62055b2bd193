/* Top-p's bands for the CPU sampler (muser/sampler.py `_top_p_prefix`; `top_p_bands` there is
 * the torch reference): for p / p_top values r in [0, 1] (float32), band b = 126 - the biased
 * exponent of r, at least 0 (r = 1 is band 0, and band b holds [2^-(b+1), 2^-b)); band 126
 * holds the subnormals and the zeros. mass[b] sums the band's r in float64 (in four interleaved
 * partial sums), count[b] counts them: one pass, no temporaries. Only the length of a candidate
 * list comes of it (the sampler checks that the list holds every survivor), so the order of
 * the sums changes no token.
 */
#include <stdint.h>
#include <string.h>

void muser_top_p_bands(const float *relative, int64_t n, double *mass, int64_t *count)
{
    /* LANES tables, element j summed into table j % LANES: most of a row falls in a few bands,
     * and one table would make every add wait for the one before it in the same band */
    enum { LANES = 4, BANDS = 127 };
    double lane_mass[LANES][BANDS] = {{0}};
    int64_t lane_count[LANES][BANDS] = {{0}};
    for (int64_t j = 0; j < n; j++) {
        uint32_t bits;
        memcpy(&bits, &relative[j], sizeof bits);
        const int32_t band = 126 - (int32_t)(bits >> 23);
        const int32_t b = band < 0 ? 0 : band;
        lane_mass[j % LANES][b] += (double)relative[j];
        lane_count[j % LANES][b] += 1;
    }
    for (int b = 0; b < BANDS; b++) {
        mass[b] = (lane_mass[0][b] + lane_mass[1][b]) + (lane_mass[2][b] + lane_mass[3][b]);
        count[b] = lane_count[0][b] + lane_count[1][b] + lane_count[2][b] + lane_count[3][b];
    }
}
